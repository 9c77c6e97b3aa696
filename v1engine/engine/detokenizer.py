"""Incremental detokenization (token ids in, new text out, a few tokens decoded per step) and the
text-level stop-string helpers the output processor uses.

Decoding each new token on its own is wrong in two ways: a multi-byte UTF-8 character split over
several byte-level tokens decodes piecewise to "\ufffd", and SentencePiece-style tokenizers drop
the leading space of the first token they decode. So every step decodes a small window that starts
a little before the new tokens (the window layout is that of vLLM/TGI's prefix/read offsets):

    _token_ids: [ ... prefix ... | ... new ... ]
                 ^0               ^_read_offset
    _prefix_text = decode(prefix)     (already emitted; gives the new tokens their context)
    delta        = decode(prefix + new)[len(_prefix_text):]

A delta is emitted only when the window's text does not end in "\ufffd" (an incomplete character
might still be completed by the next token); the new tokens then become the next prefix and the
old prefix is dropped, so each step decodes O(tokens since the last emission), never the whole
output.
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens decoded together with the first output tokens, so the first delta gets its
# leading space right (enough to cover a character split over up to 4 byte tokens).
_NUM_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """The only tokenizer method detokenization needs (any Hugging Face tokenizer has it)."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,
        spaces_between_special_tokens: bool = ...,
    ) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    Invariant: the concatenation of all deltas, the last one from `update(..., finished=True)`,
    equals `tokenizer.decode(output_token_ids, skip_special_tokens=..., ...)` for byte-level BPE
    tokenizers (GPT-2, Llama 3, SmolLM2, Qwen). Documented exceptions, both from decoding the
    output in the context of the prompt's last tokens, as a user reading prompt + output expects:
    for SentencePiece tokenizers the first delta keeps the leading space that decoding the output
    alone strips, and a character whose bytes straddle the prompt/output boundary is garbled.

    A trailing incomplete character is held back until a later token completes it; `finished`
    flushes whatever is held (as "\ufffd", exactly as a full decode would show it).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Honoured by tokenizers whose decode joins special tokens itself; fast (Rust)
        # tokenizers ignore it, as they do in vLLM.
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Only the decode window is kept: tokens before it never need decoding again.
        self._token_ids = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids)

    def update(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Adds `new_token_ids` and returns the text that became final (possibly "").

        Args:
            new_token_ids: the output tokens sampled since the last call.
            finished: no tokens will follow; emit the held-back tail too.
        """
        self._token_ids.extend(new_token_ids)
        if len(self._token_ids) == self._read_offset and not finished:
            return ""
        text = self._decode(self._token_ids)
        ready = len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT_CHAR)
        if not (ready or finished):
            # The tail may be a character still missing bytes, or tokens that decode to nothing
            # (skipped special tokens); keep them in the window and decide after the next token.
            return ""
        delta = text[len(self._prefix_text) :]
        # The tokens just emitted are the context of the next step; the old context is dropped.
        self._token_ids = self._token_ids[self._read_offset :]
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )


# Stop strings are matched on text, so their helpers live here, beside the detokenizer (as in vLLM).


def find_stop_string(text: str, num_new_chars: int, stop: list[str]) -> tuple[str, int] | None:
    """The stop string that starts earliest among those ending in the last `num_new_chars`
    characters of `text`, with its start; ties go to the one listed first."""
    if not stop or num_new_chars == 0:
        return None
    # A match must end in the new text (older matches were caught before), so it starts at most
    # len(stop) - 1 characters before the new text.
    search_start = max(len(text) - num_new_chars - max(len(s) for s in stop) + 1, 0)
    best: tuple[str, int] | None = None
    for s in stop:
        start = text.find(s, search_start)
        if start != -1 and (best is None or start < best[1]):
            best = (s, start)
    return best


def partial_stop_len(text: str, stop: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for s in stop:
        for length in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:length]):
                longest = length
                break
    return longest
