"""The engine's logprobs in the API's shapes: OpenAI's legacy completion logprobs (for generated
tokens and, with `echo`, the prompt's), and vLLM's `prompt_logprobs` extra.

JSON has no infinity: a logprob of -inf (a token the model rules out) is sent as -9999.0, as vLLM
sends it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from v1engine.entrypoints.openai.protocol import CompletionLogprobs, PromptLogprob, PromptLogprobs
from v1engine.outputs import CompletionOutput, Logprob

_LOWEST_LOGPROB = -9999.0


@dataclass
class LogprobRow:
    """One token of a legacy logprobs object; the prompt's first token has no logprob."""

    token: str
    logprob: float | None
    top_logprobs: dict[str, float] | None


def sampled_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]]
) -> list[tuple[Logprob, list[Logprob]]]:
    """Per token: its own Logprob and every candidate of its row, best rank first."""
    rows = []
    for token_id, row in zip(token_ids, logprobs):
        ranked = sorted(row.values(), key=lambda lp: lp.rank if lp.rank is not None else 0)
        rows.append((row[token_id], ranked))
    return rows


def generated_rows(output: CompletionOutput) -> list[LogprobRow]:
    assert output.logprobs is not None
    pairs = sampled_logprobs(output.token_ids, output.logprobs)
    return [_row(own, ranked) for own, ranked in pairs]


def prompt_rows(
    prompt_token_ids: list[int],
    prompt_logprobs: list[dict[int, Logprob] | None],
    decode: Callable[[int], str],
) -> list[LogprobRow]:
    """The echoed prompt's rows; the first token (nothing before it) has neither logprob nor
    alternatives, as in OpenAI's and vLLM's answers."""
    assert len(prompt_logprobs) == len(prompt_token_ids), "one entry per prompt token"
    rows = []
    for token_id, row in zip(prompt_token_ids, prompt_logprobs):
        if row is None:
            rows.append(LogprobRow(decode(token_id), None, None))
        else:
            rows.extend(_row(own, ranked) for own, ranked in sampled_logprobs([token_id], [row]))
    return rows


def _row(own: Logprob, ranked: list[Logprob]) -> LogprobRow:
    top = {lp.decoded_token or "": _finite(lp.logprob) for lp in ranked}
    return LogprobRow(own.decoded_token or "", _finite(own.logprob), top)


def completion_logprobs(rows: list[LogprobRow], text_offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs: per token its text, offset, logprob and the candidates'."""
    result = CompletionLogprobs()
    for row in rows:
        result.tokens.append(row.token)
        result.token_logprobs.append(row.logprob)
        result.top_logprobs.append(row.top_logprobs)
        result.text_offset.append(text_offset)
        text_offset += len(row.token)
    return result


def prompt_logprobs_field(
    prompt_logprobs: list[dict[int, Logprob] | None] | None,
) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` response field."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if row is None
        else {
            str(token_id): PromptLogprob(
                logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token_id, lp in row.items()
        }
        for row in prompt_logprobs
    ]


def _finite(logprob: float) -> float:
    return max(logprob, _LOWEST_LOGPROB)
