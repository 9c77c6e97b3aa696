"""What the front end hands to users: one `RequestOutput` per request (or per n > 1 parent), holding
one `CompletionOutput` per sequence, with vLLM's field names.

These objects never cross a process boundary (the front end builds them from the core's
`EngineCoreOutput`s), so they are plain dataclasses rather than msgspec Structs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One candidate token's log-probability at one position.

    `rank` is 1 for the most likely token; `decoded_token` is the token decoded on its own (a
    byte-fallback piece of a multi-byte character decodes to U+FFFD, "�").
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: {token_id: Logprob} for the sampled token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One generated sequence (cumulative, or only what is new when streaming deltas)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # The stop string that ended the text, or the stop token id; None for EOS and length.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All sequences of one request; `finished` once every sequence has finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Prompt tokens served from the prefix cache (the OpenAI usage `cached_tokens`).
    num_cached_tokens: int = 0
