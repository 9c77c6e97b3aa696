"""Logprob rows from the core -> the `{token_id: Logprob}` dicts users get, for sampled tokens
and prompt tokens alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from v1engine.outputs import Logprob, LogprobsLists

if TYPE_CHECKING:
    from v1engine.engine.output_processor import OutputKind

# Decodes one token id on its own, for `Logprob.decoded_token` (None: no text).
TokenDecoder = Callable[[int], str | None]


class PromptLogprobs:
    """One request's prompt logprobs as they arrive: None for the first prompt token, then one
    dict per scored position (the prompt token's Logprob and the top k)."""

    def __init__(self) -> None:
        self.entries: list[dict[int, Logprob] | None] = [None]
        self.sent = False

    def add(self, rows: LogprobsLists, decode_token: TokenDecoder | None) -> None:
        self.entries.extend(logprob_dicts(rows, decode_token))

    def for_output(self, output_kind: OutputKind) -> list[dict[int, Logprob] | None] | None:
        """What a RequestOutput carries: all of them, or for deltas, only on the first."""
        if output_kind == "delta" and self.sent:
            return None
        self.sent = True
        return self.entries


def logprob_dicts(
    rows: LogprobsLists, decode_token: TokenDecoder | None
) -> list[dict[int, Logprob]]:
    # Row i: column 0 is the sampled (or scored prompt) token with its rank, then the top-k by
    # rank; a token in both keeps its top-k entry.
    dicts = []
    for token_ids, logprobs, first_rank in zip(
        rows.token_ids, rows.logprobs, rows.sampled_token_ranks
    ):
        ranks = [first_rank, *range(1, len(token_ids))]
        dicts.append(
            {
                token_id: Logprob(
                    logprob, rank, None if decode_token is None else decode_token(token_id)
                )
                for token_id, logprob, rank in zip(token_ids, logprobs, ranks)
            }
        )
    return dicts
