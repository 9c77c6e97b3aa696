"""One `schedule()` call's decisions (`StepPlan`) turned into the `SchedulerOutput` the workers
apply: new requests whole, running ones as diffs (the contract is in
`v1engine/worker/request_states.py`), and the grammar bitmask rows of the structured requests
that sample this step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from v1engine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from v1engine.core.structured_output_manager import StructuredOutputManager
from v1engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from v1engine.request import Request


@dataclass
class StepPlan:
    """What one `schedule()` call has decided so far."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Blocks each scheduled request gained this step.
    new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Drafted tokens the step verifies, by request (counted in its scheduled tokens).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def add(
        self,
        request: Request,
        num_tokens: int,
        new_blocks: KVCacheBlocks,
        drafts: list[int] | None = None,
    ) -> None:
        assert request.request_id not in self.num_scheduled_tokens
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.new_blocks[request.request_id] = new_blocks
        self.token_budget -= num_tokens
        if drafts:
            self.spec_token_ids[request.request_id] = drafts


def build_scheduler_output(
    plan: StepPlan,
    requests: dict[str, Request],
    kv_cache_manager: KVCacheManager,
    finished_req_ids: set[str],
    structured_output_manager: StructuredOutputManager | None,
) -> SchedulerOutput:
    """The step's SchedulerOutput; called before the scheduled requests' computed-token counts
    advance, so each diff carries the count the step starts from."""
    new_reqs = [_new_request_data(request, kv_cache_manager) for request in plan.new_reqs]
    cached = CachedRequestData()
    for req_id in plan.num_scheduled_tokens:
        request = requests[req_id]
        if not request.sent_to_workers:
            continue  # in new_reqs
        resumed = req_id in plan.resumed_req_ids
        cached.req_ids.append(req_id)
        cached.resumed_from_preemption.append(resumed)
        if resumed:
            cached.new_block_ids.append(kv_cache_manager.get_block_ids(req_id))
        else:
            cached.new_block_ids.append(_block_ids_or_none(plan.new_blocks[req_id]))
        cached.num_computed_tokens.append(request.num_computed_tokens)
    for request in plan.new_reqs:
        request.sent_to_workers = True
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=plan.num_scheduled_tokens,
        total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
        finished_req_ids=finished_req_ids,
        preempted_req_ids=plan.preempted_req_ids,
        scheduled_spec_decode_tokens=plan.spec_token_ids,
        **_grammar_bitmask(plan, requests, structured_output_manager),
    )


def _grammar_bitmask(
    plan: StepPlan,
    requests: dict[str, Request],
    structured_output_manager: StructuredOutputManager | None,
) -> dict:
    """The bitmask rows of the structured requests that sample this step (a partial prefill
    chunk samples nothing, so it has no row), each request's first row by its id: one row, and
    one more per draft it verifies. The scheduler never runs a structured request ahead of its
    last sampled token, so each matcher has seen every earlier token."""
    sampling, drafts = [], []
    for req_id, num_tokens in plan.num_scheduled_tokens.items():
        request = requests[req_id]
        request_drafts = plan.spec_token_ids.get(req_id, [])
        num_known = num_tokens - len(request_drafts)
        computed = request.num_computed_tokens + num_known == request.num_tokens_with_placeholders
        if request.use_structured_output and computed:
            sampling.append(request)
            drafts.append(request_drafts)
    if not sampling:
        return {}
    assert structured_output_manager is not None
    first_rows = itertools.accumulate((1 + len(d) for d in drafts), initial=0)
    return {
        "structured_output_request_ids": {
            request.request_id: row for request, row in zip(sampling, first_rows)
        },
        "grammar_bitmask": structured_output_manager.grammar_bitmask(sampling, drafts),
    }


def _new_request_data(request: Request, kv_cache_manager: KVCacheManager) -> NewRequestData:
    assert request.num_tokens == request.num_prompt_tokens
    return NewRequestData(
        req_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=request.sampling_params,
        block_ids=kv_cache_manager.get_block_ids(request.request_id),
        num_computed_tokens=request.num_computed_tokens,
        lora_request=request.lora_request,
    )


def _block_ids_or_none(blocks: KVCacheBlocks) -> tuple[list[int], ...] | None:
    if not any(blocks):
        return None
    return tuple([block.block_id for block in group] for group in blocks)
