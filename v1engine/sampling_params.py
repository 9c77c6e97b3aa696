"""SamplingParams: how one request picks its tokens. Invalid values raise ValueError naming the
field, the value and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from v1engine.structured_outputs.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # Per output token: its logprob and the k most likely tokens'; -1 (vLLM's): every token's,
    # within the engine's max_logprobs.
    logprobs: int | None = None
    # Per prompt token after the first: its logprob and the k most likely tokens' (vLLM's).
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # OpenAI's logit_bias: token id -> value added to its logit before sampling.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: False leaves the output's text empty (and logprobs' decoded_token None), for
    # callers that want token ids only and not the detokenizing cost.
    detokenize: bool = True
    # Keep only the last k prompt tokens; -1: as many as max_model_len leaves room for.
    truncate_prompt_tokens: int | None = None
    # A JSON schema, regex, choice or grammar the output must follow (a dict is taken as the
    # StructuredOutputsParams fields).
    structured_outputs: StructuredOutputsParams | None = None
    # Set by the engine, not by users (vLLM's names): each bad word as token-id sequences
    # (tokenized by the processor), and the EOS id the workers mask until min_tokens.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    _eos_token_id: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = _int_keys(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first field out of range. Runs at construction (and when
        msgspec decodes one); `validate_request` runs it again for params changed since."""
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "must be >= 1 (or None: up to max_model_len)",
        )
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", self.top_k, "must be -1, 0 or >= 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, value, "must be in [-2, 2]")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            self.repetition_penalty,
            "must be > 0",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= -1, name, value, "must be >= 0, or -1 (every token)")
        _check(all(s for s in self.stop), "stop", self.stop, "must not contain empty strings")
        _check(
            self.detokenize or not self.stop,
            "detokenize",
            self.detokenize,
            "must be True with stop strings (they are matched in the text); use stop_token_ids",
        )
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            self.structured_outputs,
            "must be a StructuredOutputsParams (or a dict of its fields)",
        )
        self._validate_token_constraints()

    def _validate_token_constraints(self) -> None:
        max_tokens = self.max_tokens
        _check(
            0 <= self.min_tokens and (max_tokens is None or self.min_tokens <= max_tokens),
            "min_tokens",
            self.min_tokens,
            f"must be in [0, max_tokens={max_tokens}]",
        )
        bias = self.logit_bias or {}
        out_of_range = {t: b for t, b in bias.items() if not -100.0 <= b <= 100.0}
        _check(not out_of_range, "logit_bias", out_of_range, "values must be in [-100, 100]")
        _check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
            "allowed_token_ids",
            self.allowed_token_ids,
            "must not be empty (None allows every token)",
        )
        _check(
            all(w.strip() for w in self.bad_words or []),
            "bad_words",
            self.bad_words,
            "must not contain empty or blank strings",
        )
        truncate = self.truncate_prompt_tokens
        _check(
            truncate is None or truncate == -1 or truncate >= 1,
            "truncate_prompt_tokens",
            truncate,
            "must be >= 1, or -1 (as many as max_model_len allows)",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


@dataclass
class BeamSearchParams:
    """How `LLM.beam_search` (and `use_beam_search` in the API) searches: keep the `beam_width`
    most likely sequences, extend each by its `2 * beam_width` most likely next tokens per step,
    for at most `max_tokens` steps. vLLM's names and defaults.

    A sequence's score is its cumulative logprob / its length ** `length_penalty`, the length
    counting prompt and output tokens but not a final EOS (vLLM's rule): 0 ranks by the sum alone,
    1 by the mean per token, and higher values favour longer sequences more. `temperature`
    samples one more candidate per beam and step; 0 keeps the search deterministic. The EOS ends
    a beam (kept in its tokens with `include_stop_str_in_output`) unless `ignore_eos`.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        name = "BeamSearchParams"
        _check(self.beam_width >= 1, "beam_width", self.beam_width, "must be >= 1", name)
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1", name)
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0", name)
        _check(
            math.isfinite(self.length_penalty),
            "length_penalty",
            self.length_penalty,
            "must be a finite number",
            name,
        )


def _int_keys(logit_bias: dict) -> dict[int, float]:
    # JSON objects have string keys: {"50256": -100} means token 50256.
    try:
        return {int(k): float(v) for k, v in logit_bias.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"SamplingParams.logit_bias must map token ids to numbers, got {logit_bias!r}"
        ) from e


def _check(ok: bool, name: str, value: object, rule: str, owner: str = "SamplingParams") -> None:
    if not ok:
        raise ValueError(f"{owner}.{name} {rule}, got {value!r}")
