"""The scheduler's side of speculative decoding (the workers' side: `worker/spec_decode.py`).

A running request may carry drafted tokens (`Request.spec_token_ids`, proposed by the workers
with the step that sampled its last token). The scheduler sends them with the request's next
step (`SchedulerOutput.scheduled_spec_decode_tokens`), counted in its scheduled tokens and the
token budget, with KV slots for them, but not in `num_computed_tokens`: only when the step's
tokens come back (the drafts the model agreed with, then one token of its own) does the count
advance over the drafts accepted. The slots of rejected drafts are written again by later steps;
no prefix-cache block ever holds a draft, since blocks are cached up to the known tokens only.

A request with a grammar keeps only the drafts its grammar accepts, in order: the first it
rejects, and every draft after it, are dropped before they take a slot
(`StructuredOutputManager.valid_drafts`); its step then carries a bitmask row per verifying row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from v1engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from v1engine.core.structured_output_manager import StructuredOutputManager


class SpecDecoding:
    """The scheduler's drafts: what a step verified, what comes next; and cumulative counts for
    its stats (vLLM's spec_decode metrics)."""

    def __init__(
        self,
        max_model_len: int,
        structured_output_manager: StructuredOutputManager | None = None,
    ) -> None:
        self.max_model_len = max_model_len
        self.structured_output_manager = structured_output_manager
        self.num_drafts = 0  # request-steps that verified drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def stats(self) -> dict[str, int]:
        return {
            "num_spec_drafts": self.num_drafts,
            "num_spec_draft_tokens": self.num_draft_tokens,
            "num_spec_accepted_tokens": self.num_accepted_tokens,
        }

    def update(
        self,
        request: Request,
        verified: list[int] | None,
        sampled: list[int],
        drafts: list[int] | None,
    ) -> None:
        """After a step's `sampled` tokens were appended to `request`: counts the `verified`
        drafts it accepted as computed, and keeps the workers' new `drafts` for its next step."""
        if verified:
            # The workers returned the accepted drafts and one token more; the accepted
            # drafts' KV is in the cache now.
            num_accepted = len(sampled) - 1
            assert 0 <= num_accepted <= len(verified), (verified, sampled)
            request.num_computed_tokens += num_accepted
            self.num_drafts += 1
            self.num_draft_tokens += len(verified)
            self.num_accepted_tokens += num_accepted
        if drafts and request.status == RequestStatus.RUNNING:
            # Every accepted draft and the token after them are output tokens: together they
            # stay within max_tokens and max_model_len.
            room = min(
                request.max_tokens - request.num_output_tokens,
                self.max_model_len - request.num_tokens,
            )
            drafts = drafts[: max(0, room - 1)]
            if drafts and request.use_structured_output:
                assert self.structured_output_manager is not None
                drafts = self.structured_output_manager.valid_drafts(request, drafts)
            request.spec_token_ids = drafts
