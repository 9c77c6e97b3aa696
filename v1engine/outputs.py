"""What each stage outputs: the scheduler's step for the workers, the model runner's reply, and
the `RequestOutput`s users get (at the end).

Between the scheduler and the workers, `SchedulerOutput` sends a request whole the first time it
is scheduled (`NewRequestData`) and afterwards only what changed (`CachedRequestData`). The full
contract (what workers keep, drop and rebuild, and in which order) is written out in
`v1engine/worker/request_states.py`, the one module that applies it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from v1engine.lora.request import LoRARequest
from v1engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # One block-id list per KV cache group.
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None


@dataclass
class CachedRequestData:
    """Column-wise diffs of the running requests scheduled this step."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    # Blocks added this step per group (the whole table when resumed), or None.
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # req_id -> tokens computed this step, for every scheduled request.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests done since the last step (finished, aborted): workers drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted since the last step: workers free their batch slots, keep their tokens.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured requests that sample this step -> their row of grammar_bitmask, a
    # [num_rows, ceil(vocab_size / 32)] int32 array: bit t % 32 of word t // 32 set iff token t
    # may be sampled (xgrammar's packing). The sampling rank masks those logits rows with it.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: req_id -> the drafted tokens this step verifies, after the request's
    # known tokens (counted in its num_scheduled_tokens; see worker/spec_decode.py).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class LogprobsLists:
    """Per sampled (or scored prompt) token: [that token, top-k tokens...] ids and logprobs, and
    its rank.

    In one step every row has 1 + k columns, k being the most logprobs any request of the batch
    asked for; consumers keep the first 1 + (their own k) columns.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]

    def rows(self, start: int, stop: int) -> LogprobsLists:
        """The rows start .. stop - 1 (itself when that is all of them: the common case)."""
        if start == 0 and stop >= len(self.token_ids):
            return self
        return LogprobsLists(
            self.token_ids[start:stop],
            self.logprobs[start:stop],
            self.sampled_token_ranks[start:stop],
        )


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # Per request in req_ids: the tokens sampled this step ([] for a partial prefill chunk).
    sampled_token_ids: list[list[int]]
    # A row per sampled token, the requests' in req_ids order (a request that verified drafts
    # has one per token it emitted), or None without logprobs.
    logprobs: LogprobsLists | None = None
    # Per request asking for prompt logprobs and scoring prompt tokens this step: one row per
    # prompt position p run this step, in order, scoring prompt token p + 1 (column 0 and its
    # rank), then the request's own top k (see worker/prompt_logprobs.py).
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # A pooling engine's: per request whose prompt ended this step, its last token's final
    # hidden state (it samples nothing; see pooling_params.py).
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # Speculative decoding: per request in req_ids, the tokens drafted for its next step.
    spec_token_ids: list[list[int]] | None = None

    def logprobs_by_request(self) -> dict[str, LogprobsLists]:
        """The step's logprobs per sampling request: a row per token it sampled."""
        lists = self.logprobs
        if lists is None:
            return {}
        by_request, row = {}, 0
        for req_id, tokens in zip(self.req_ids, self.sampled_token_ids):
            if tokens:
                by_request[req_id] = lists.rows(row, row + len(tokens))
                row += len(tokens)
        return by_request


# -- what users get ------------------------------------------------------------------------------
# The front end builds these from the core's `EngineCoreOutput`s (engine/output_processor.py);
# they never cross a process boundary, so they are plain dataclasses with vLLM's field names:
# one `RequestOutput` per request (or per n > 1 parent), one `CompletionOutput` per sequence.


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


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def data(self) -> torch.Tensor:
        """The embedding as a float32 tensor (vLLM's `PoolingOutput.data`)."""
        return _tensor(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # per class, after the model's activation (or its logits without)

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    @property
    def data(self) -> torch.Tensor:
        """The scores as a float32 tensor (vLLM's `PoolingOutput.data`)."""
        return _tensor(self.probs)


def _tensor(values: list[float]) -> torch.Tensor:
    import torch  # here: the API server's process never loads torch for its outputs

    return torch.tensor(values, dtype=torch.float32)


PooledT = TypeVar("PooledT")  # what a pooling request returns: an embedding, class scores


@dataclass
class PoolingRequestOutput(Generic[PooledT]):
    """One prompt's pooled result; `finished` is always True."""

    request_id: str
    outputs: PooledT
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """vLLM's `LLM.embed` result."""


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """vLLM's `LLM.classify` result."""


@dataclass
class ScoringOutput:
    score: float


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """One text pair's score (vLLM's `LLM.score` result)."""


async def final_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The last of a request's streamed outputs (`AsyncLLM.add_request`'s), once it finished."""
    final = None
    async for output in outputs:
        final = output
    assert final is not None and final.finished
    return final
