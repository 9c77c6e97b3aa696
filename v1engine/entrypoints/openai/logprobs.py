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
) -> list[tuple[tuple[int, Logprob], list[tuple[int, Logprob]]]]:
    """Per token: (its id, its Logprob) and every candidate of its row as (id, Logprob), best
    rank first."""
    rows = []
    for token_id, row in zip(token_ids, logprobs):
        ranked = sorted(row.items(), key=lambda item: item[1].rank or 0)
        rows.append(((token_id, row[token_id]), ranked))
    return rows


def token_name(token_id: int, decoded: str | None, as_ids: bool) -> str:
    """How a logprobs entry names its token: its text, or with vLLM's
    `return_tokens_as_token_ids` "token_id:{id}" (unique, where two tokens may decode alike, and
    valid JSON where a token is part of a UTF-8 character)."""
    return f"token_id:{token_id}" if as_ids else (decoded or "")


def generated_rows(output: CompletionOutput, as_ids: bool) -> list[LogprobRow]:
    assert output.logprobs is not None
    pairs = sampled_logprobs(output.token_ids, output.logprobs)
    return [_row(own, ranked, as_ids) for own, ranked in pairs]


def prompt_rows(
    prompt_token_ids: list[int],
    prompt_logprobs: list[dict[int, Logprob] | None],
    decode: Callable[[int], str],
    as_ids: bool,
) -> list[LogprobRow]:
    """The echoed prompt's rows; the first token (nothing before it) has neither logprob nor
    alternatives, as in OpenAI's and vLLM's answers."""
    assert len(prompt_logprobs) == len(prompt_token_ids), "one entry per prompt token"
    rows = []
    for token_id, row in zip(prompt_token_ids, prompt_logprobs):
        if row is None:
            rows.append(LogprobRow(token_name(token_id, decode(token_id), as_ids), None, None))
        else:
            pairs = sampled_logprobs([token_id], [row])
            rows.extend(_row(own, ranked, as_ids) for own, ranked in pairs)
    return rows


def _row(own: tuple[int, Logprob], ranked: list[tuple[int, Logprob]], as_ids: bool) -> LogprobRow:
    top = {token_name(i, lp.decoded_token, as_ids): finite(lp.logprob) for i, lp in ranked}
    return LogprobRow(token_name(own[0], own[1].decoded_token, as_ids), finite(own[1].logprob), top)


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


def prompt_logprobs_field(prompt_logprobs: list[dict[int, Logprob] | None]) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` response field (callers skip the call when there are none)."""
    return [
        None
        if row is None
        else {
            str(token_id): PromptLogprob(
                logprob=finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token_id, lp in row.items()
        }
        for row in prompt_logprobs
    ]


def finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf (a token ruled out) as -9999.0, as vLLM sends it."""
    return max(logprob, _LOWEST_LOGPROB)
