"""Requests as the client sends them, as the scheduler tracks them, and what the core sends back.

`EngineCoreRequest`, `EngineCoreOutput(s)` and `SchedulerStats` cross the ZeroMQ socket between
the client and the engine process, so they are `msgspec.Struct`s (msgpack, never pickle).
`Request` is the scheduler's own mutable record and never leaves the engine process.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Container
from typing import TYPE_CHECKING

import msgspec

from v1engine.core_protocol import EngineCoreInfo
from v1engine.lora.request import LoRARequest
from v1engine.outputs import LogprobsLists
from v1engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1engine.core.structured_output_manager import StructuredOutputRequest


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One generation request, already tokenized; see `validate_request`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = msgspec.field(default_factory=time.time)
    priority: int = 0  # with the "priority" scheduling policy: lower is served first
    # vLLM's: requests share prefix-cache blocks only with requests of the same salt.
    cache_salt: str | None = None
    # The LoRA adapter it runs with; None: the base model.
    lora_request: LoRARequest | None = None


def validate_request(
    request: EngineCoreRequest, info: EngineCoreInfo, live_request_ids: Container[str]
) -> None:
    """The one check of a request against the engine's limits (`info`): at the edge (the
    processor, before anything is sent) and again in the core, which cannot trust its socket.

    Raises:
        ValueError: the request cannot be served; the message says why and what to change.
    """
    request_id, prompt = request.request_id, request.prompt_token_ids
    max_model_len, vocab_size = info.max_model_len, info.vocab_size
    if not isinstance(request_id, str):
        raise ValueError(f"request_id must be a str, got {request_id!r}")
    if not prompt:
        raise ValueError(f"request {request_id!r}: the prompt is empty; send at least one token")
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"request {request_id!r}: the prompt has {len(prompt)} tokens but max_model_len is "
            f"{max_model_len}, leaving no room for output; shorten the prompt or raise "
            "max_model_len"
        )
    # min and max first: the scan that lists the bad ids is ten times slower, and n > 1 requests
    # run this check once per child.
    if vocab_size is not None and (min(prompt) < 0 or max(prompt) >= vocab_size):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        raise ValueError(
            f"request {request_id!r}: prompt token ids {bad[:5]} are outside the vocabulary; "
            f"this model's ids are in [0, {vocab_size})"
        )
    if request_id in live_request_ids:
        raise ValueError(f"request id {request_id!r} is already in use")
    salt = request.cache_salt
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ValueError(f"cache_salt must be a non-empty string (or None), got {salt!r}")
    if request.lora_request is not None and info.max_loras == 0:
        raise ValueError(
            f"request {request_id!r} names LoRA adapter {request.lora_request.lora_name!r} but "
            "this engine serves no adapters; start it with enable_lora=True (--enable-lora)"
        )
    request.sampling_params.validate()
    _check_num_logprobs(request_id, request.sampling_params, info.max_logprobs)
    if vocab_size is not None:
        _check_sampling_token_ids(request_id, request.sampling_params, vocab_size)
    elif request.sampling_params.structured_outputs is not None:
        raise ValueError(
            f"request {request_id!r}: structured outputs need a model (its vocabulary), and this "
            "engine runs a model-free worker class"
        )


def _check_num_logprobs(request_id: str, params: SamplingParams, max_logprobs: int) -> None:
    """Within the engine's max_logprobs (the processor has replaced -1 by the vocabulary size)."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and max_logprobs != -1 and value > max_logprobs:
            raise ValueError(
                f"request {request_id!r}: SamplingParams.{name} asks for {value} logprobs per "
                f"token (-1: the whole vocabulary) but this engine's max_logprobs is "
                f"{max_logprobs}; ask for fewer, or raise max_logprobs (LLM(max_logprobs=...), "
                "--max-logprobs; -1: no limit)"
            )


def _check_sampling_token_ids(request_id: str, params: SamplingParams, vocab_size: int) -> None:
    """The sampler indexes the logits with these ids, so each must be in the vocabulary."""
    bad_words_ids = [t for ids in params._bad_words_token_ids or [] for t in ids]
    structured = params.structured_outputs
    reasoning_end = None if structured is None else structured._reasoning_end_token_id
    for name, ids in (
        ("logit_bias", list(params.logit_bias or ())),
        ("allowed_token_ids", params.allowed_token_ids or []),
        ("bad_words", bad_words_ids),
        ("structured_outputs", [] if reasoning_end is None else [reasoning_end]),
    ):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"request {request_id!r}: SamplingParams.{name} has token ids {bad[:5]} outside "
                f"the vocabulary; this model's ids are in [0, {vocab_size})"
            )


class FinishReason(str, enum.Enum):
    """Why a request stopped, spelled as in the OpenAI API and vLLM."""

    STOP = "stop"  # EOS or one of stop_token_ids
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client cancelled it
    ERROR = "error"  # the engine could not serve it (its grammar failed to compile)

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    # Queued, but its structured-output grammar is still compiling: not scheduled yet.
    WAITING_FOR_FSM = enum.auto()
    RUNNING = enum.auto()
    # Blocks freed by the scheduler; recomputed from scratch when scheduled again.
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """The scheduler's record of one request.

    Invariants: `all_token_ids == prompt_token_ids + output_token_ids`;
    `num_computed_tokens <= num_tokens + num_output_placeholders` counts the leading tokens whose
    KV is in the cache or being written by a scheduled step (the scheduler advances it when it
    schedules; preemption resets it); `num_output_placeholders` counts the tokens scheduled steps
    will sample but whose values have not arrived; `sent_to_workers` is False until the request's
    first schedule sends it whole as a `NewRequestData` (later ones send diffs).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        max_model_len: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.prompt_token_ids = list(prompt_token_ids)
        if sampling_params.min_tokens > 0 and sampling_params._eos_token_id != eos_token_id:
            # The workers mask EOS until min_tokens and know it only from the params (a copy:
            # the caller's params may be shared).
            sampling_params = dataclasses.replace(sampling_params, _eos_token_id=eos_token_id)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache the first time the request was scheduled.
        self.num_cached_tokens = 0
        self.num_output_placeholders = 0
        # Speculative decoding: tokens drafted for its next step, not yet verified (never in
        # all_token_ids or num_computed_tokens).
        self.spec_token_ids: list[int] = []
        self.sent_to_workers = False
        # When the engine core queued it and first scheduled it, on the core's monotonic clock
        # (0.0: not yet); sent with its first output, for the queue and prefill time metrics.
        self.queued_ts = time.monotonic()
        self.scheduled_ts = 0.0
        # The stop token id when stopped by `stop_token_ids` (EOS leaves it None).
        self.stop_reason: int | None = None
        # Hash of each FULL block of all_token_ids, filled in by the KVCacheManager.
        self.block_hashes: list[bytes] = []
        self.max_tokens = _resolve_max_tokens(
            sampling_params.max_tokens, len(self.prompt_token_ids), max_model_len
        )
        # Its grammar's compile and matcher (StructuredOutputManager), with structured outputs.
        self.structured_output_request: StructuredOutputRequest | None = None

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest, max_model_len: int) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            max_model_len=max_model_len,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_request=request.lora_request,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those scheduled steps will sample: where the next step starts
        sampling again."""
        return self.num_tokens + self.num_output_placeholders

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0: the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return self.status.is_finished()

    def get_finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finishes `request` if its last output token ends it; returns whether it did.

    Order (the first that applies names the reason): EOS, unless `ignore_eos` or the model has
    no EOS token; one of `stop_token_ids` (recorded as `stop_reason`); `max_tokens`;
    `max_model_len`. EOS and stop tokens count only once the output has `min_tokens` tokens
    (the sampler masks them before). The stopping token stays in the output, as in vLLM.
    """
    held_off = request.num_output_tokens < request.sampling_params.min_tokens
    if not held_off and _stopped_by_token(request):
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def _stopped_by_token(request: Request) -> bool:
    """Whether the last output token is EOS (not ignored) or a stop token (then `stop_reason`)."""
    last_token_id = request.output_token_ids[-1]
    params = request.sampling_params
    eos_token_id = request.eos_token_id
    if not params.ignore_eos and eos_token_id is not None and last_token_id == eos_token_id:
        return True
    if last_token_id in params.stop_token_ids:
        request.stop_reason = last_token_id
        return True
    return False


def _resolve_max_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    # The room left in the context; at least 1 because the prefill step always samples a token
    # (a prompt of exactly max_model_len tokens gets one output token, never computed into KV).
    room = max(max_model_len - num_prompt_tokens, 1)
    return room if max_tokens is None else min(max_tokens, room)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request produced in one step: its new tokens (and scored prompt positions) and,
    once, why it finished."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    # One row per token in new_token_ids (same layout as ModelRunnerOutput.logprobs).
    new_logprobs: LogprobsLists | None = None
    # The prompt positions scored this step, in order (ModelRunnerOutput.prompt_logprobs); a
    # prefill chunk that samples nothing still sends them, with no new tokens.
    new_prompt_logprobs: LogprobsLists | None = None
    # Prompt tokens served from the prefix cache (the OpenAI usage `cached_tokens`).
    num_cached_tokens: int = 0
    # On the request's first output only (0.0 on the others): `Request.queued_ts` and
    # `Request.scheduled_ts`, for the metrics.
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    # A pooling engine's result, with the request's finish: ModelRunnerOutput.pooler_output.
    pooling_output: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """A snapshot of the scheduler; the prefix-cache and preemption counts are cumulative."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of the usable blocks held by requests
    num_prefix_cache_query_tokens: int = 0
    num_prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    # With LoRA: adapter name -> its requests running, and waiting (vLLM's).
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    # Speculative decoding: requests steps verified drafts for, the drafted tokens, and those
    # accepted.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.num_prefix_cache_query_tokens == 0:
            return 0.0
        return self.num_prefix_cache_hit_tokens / self.num_prefix_cache_query_tokens


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    # When the engine core made them, on its monotonic clock (for the latency metrics: only
    # differences of the core's timestamps mean anything).
    timestamp: float = msgspec.field(default_factory=time.monotonic)
