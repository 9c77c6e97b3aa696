"""A step's tokens: the driver samples them from the hidden states of the rows the LM head reads,
and every rank receives them (each appends them to its request states).

A row per sampling request, or under speculative decoding a row more per draft it verifies
(`spec_decode.py`). Structured requests sample within the grammar bitmask the scheduler sent. A
greedy step of a few rows on one CPU rank reads the LM head through the greedy screen
(`model/layers/greedy_screen.py`) instead of computing whole logits rows.
"""

from __future__ import annotations

import torch

from v1engine.model.derived_weights import DerivedWeights
from v1engine.model.layers.sampler import LogprobsTensors, Sampler
from v1engine.model.layers.sampling_metadata import SamplingMetadata
from v1engine.model.parallel_state import broadcast_from_driver
from v1engine.outputs import LogprobsLists, SchedulerOutput
from v1engine.worker.model_inputs import (
    ModelInputs,
    build_sampling_metadata,
    grammar_bitmask_rows,
    to_logprobs_lists,
)
from v1engine.worker.request_states import RequestStates
from v1engine.worker.spec_decode import emitted_rows, emitted_tokens, expand_rows


class StepSampler:
    def __init__(
        self,
        model: torch.nn.Module,
        sampler: Sampler,
        derived: DerivedWeights,
        vocab_size: int,
        is_driver: bool,
        tp_size: int,
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.derived = derived
        self.vocab_size = vocab_size
        self.is_driver = is_driver
        self.tp_size = tp_size

    def sample(
        self,
        hidden: torch.Tensor,
        inputs: ModelInputs,
        req_ids: list[str],
        states: RequestStates,
        scheduler_output: SchedulerOutput,
    ) -> tuple[list[list[int]], LogprobsLists | None]:
        """Per request, the tokens it samples ([] for a partial prefill chunk; the accepted
        drafts and one more with drafts), and the logprobs of those tokens (a row each, in
        order), when any request asks for them. `hidden`: the hidden states of the rows the LM
        head reads."""
        sampled: list[list[int]] = [[] for _ in req_ids]
        if not inputs.sampling_rows:  # only partial prefill chunks
            return sampled, None
        verified = scheduler_output.scheduled_spec_decode_tokens
        drafts = None
        if verified:
            drafts = [verified.get(req_ids[row], []) for row in inputs.sampling_rows]
        logprobs = None
        if self.is_driver:
            token_ids, logprobs = self._driver_sample(
                hidden,
                [req_ids[row] for row in inputs.sampling_rows],
                states,
                drafts,
                scheduler_output,
            )
        else:
            self.model.compute_logits(hidden)  # the LM head gathers over every rank
            token_ids = torch.empty(len(hidden), dtype=torch.int64, device=hidden.device)
        if self.tp_size > 1:
            token_ids = broadcast_from_driver(token_ids)
        tokens = token_ids.tolist()
        per_request = [[t] for t in tokens] if drafts is None else emitted_tokens(drafts, tokens)
        for row, emitted in zip(inputs.sampling_rows, per_request, strict=True):
            sampled[row] = emitted
        if logprobs is not None and drafts is not None:  # only the emitted tokens' rows
            rows = torch.tensor(emitted_rows(drafts, per_request), device=hidden.device)
            logprobs = LogprobsTensors(
                logprobs.token_ids[rows],
                logprobs.logprobs[rows],
                logprobs.sampled_token_ranks[rows],
            )
        return sampled, to_logprobs_lists(logprobs)

    def _driver_sample(
        self,
        hidden: torch.Tensor,
        sampling_req_ids: list[str],
        states: RequestStates,
        drafts: list[list[int]] | None,
        scheduler_output: SchedulerOutput,
    ) -> tuple[torch.Tensor, LogprobsTensors | None]:
        """Each logits row's token [rows] and logprobs, on the driver."""
        row_states = [states.requests[req_id] for req_id in sampling_req_ids]
        bitmask = grammar_bitmask_rows(sampling_req_ids, scheduler_output)
        if drafts is not None:
            row_states, bitmask = expand_rows(row_states, drafts, bitmask)
        metadata = build_sampling_metadata(row_states, self.vocab_size, hidden.device, bitmask)
        token_ids = self._greedy_screen(hidden, metadata)
        if token_ids is not None:
            return token_ids, None
        output = self.sampler(self.model.compute_logits(hidden), metadata)
        return output.sampled_token_ids, output.logprobs

    def _greedy_screen(
        self, hidden: torch.Tensor, metadata: SamplingMetadata
    ) -> torch.Tensor | None:
        screen = self.derived.greedy_screen
        if screen is not None and metadata.argmax_only and screen.applies(len(hidden)):
            return screen.argmax(hidden)
        return None
