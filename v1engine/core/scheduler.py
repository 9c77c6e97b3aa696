"""The token-budget scheduler: which requests compute how many tokens each step.

There are no prefill and decode phases. Each request has `num_tokens` tokens known (prompt plus
outputs) and `num_computed_tokens` already in the KV cache; a step gives requests some of the
difference under one budget of `max_num_batched_tokens`. A decode is simply a request one token
behind; a long prompt is chunked across steps because the budget runs out (chunked prefill).

`schedule()` in three steps:
1. RUNNING requests, oldest first, each min(tokens left, budget) tokens, plus the drafts it
   carries under speculative decoding (`spec_decode.py`). When the pool cannot hold a request's
   new tokens, the newest running request is preempted (blocks freed, back to the front of the
   waiting queue, recomputed later) and the allocation retried; it may be the request itself.
2. WAITING requests, first come first served, while budget, `max_num_seqs` and blocks last (the
   head is never overtaken, except by requests whose grammar is still compiling, and by those of
   a LoRA adapter while `max_loras` others run: those are skipped). Prefix-cache hits count as
   computed (not for a request asking for prompt logprobs: it must compute every position).
   Skipped in a step that preempted: blocks just ran out.
3. The `SchedulerOutput` (`scheduler_output.py`); the scheduled requests' `num_computed_tokens`
   advance, and each request that samples this step gains an output placeholder, which
   `update_from_output()` fills with the step's tokens (or a pooling engine's hidden state),
   advancing grammars and finishing requests.

The "priority" policy (vLLM's) keeps both queues in (priority, arrival time) order, lower first:
the waiting head is the most urgent request (a preempted one goes back to its place), running
requests get the budget in that order, and the least urgent (latest among equals) is preempted.

Async scheduling (step N+1 planned while the workers run step N): a request whose token of step
N is still a placeholder is scheduled one more token on top of it, which the workers fill in
themselves (they append what they sample). Not when the placeholders may reach its length
limits, nor with a grammar (its bitmask needs every earlier token); a preempted request resumes
only after its in-flight token arrived; a token sampled for a request finished since is dropped.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable

from v1engine.config import CacheConfig, SchedulerConfig
from v1engine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from v1engine.core.scheduler_output import StepPlan, build_scheduler_output
from v1engine.core.spec_decode import SpecDecoding
from v1engine.core.structured_output_manager import StructuredOutputManager
from v1engine.kv_cache_interface import KVCacheConfig
from v1engine.logger import init_logger
from v1engine.lora.request import adapter_counts
from v1engine.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from v1engine.request import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    Request,
    RequestStatus,
    SchedulerStats,
    check_stop,
)

logger = init_logger(__name__)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_config: KVCacheConfig,
        structured_output_manager: StructuredOutputManager | None = None,
        max_loras: int = 0,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.structured_output_manager = structured_output_manager
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        # LoRA adapters the running requests may use at once (each worker's slots).
        self.max_loras = max_loras
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len=self.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.by_priority = scheduler_config.policy == "priority"
        # Every unfinished request, by id; each is in exactly one of `waiting` and `running`.
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # In admission order (or priority order), so the last one is the one preempted first.
        self.running: list[Request] = []
        # Finished or aborted since the last SchedulerOutput: the workers drop their state.
        self.finished_req_ids: set[str] = set()
        # Requests whose grammar failed to compile, reported by the next update_from_output.
        self.grammar_error_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        self.spec_decoding = SpecDecoding(self.max_model_len, self.structured_output_manager)

    def add_request(self, request: Request) -> None:
        """Queues a validated request (EngineCore.add_request checks user input)."""
        assert request.request_id not in self.requests, f"duplicate {request.request_id!r}"
        assert request.status == RequestStatus.WAITING and request.num_prompt_tokens > 0
        if request.use_structured_output:
            assert self.structured_output_manager is not None, "structured outputs need a manager"
            self.structured_output_manager.grammar_init(request)
        self.requests[request.request_id] = request
        self._put(self.waiting, request, self.waiting.append)

    def _put(
        self,
        queue: deque[Request] | list[Request],
        request: Request,
        first_come: Callable[[Request], None],
    ) -> None:
        """Puts `request` in its place in `queue`: by (priority, arrival) under the priority
        policy, else where `first_come` puts it (the back, or a preempted request's front)."""
        if self.by_priority:
            bisect.insort(queue, request, key=lambda r: (r.priority, r.arrival_time))
        else:
            first_come(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """Whether requests finished since the last schedule (the workers still hold them)."""
        return bool(self.finished_req_ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- schedule -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plans one step. May run while earlier steps are still on the workers (async
        scheduling): their sampled tokens are then placeholders, counted but not yet known."""
        plan = StepPlan(token_budget=self.max_num_batched_tokens)
        self._check_grammars()
        self._schedule_running(plan)
        if not plan.preempted_req_ids:
            self._schedule_waiting(plan)
        output = build_scheduler_output(
            plan,
            self.requests,
            self.kv_cache_manager,
            self.finished_req_ids,
            self.structured_output_manager,
        )
        self.finished_req_ids = set()
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            # Drafts count as computed only once verified (core/spec_decode.py).
            request.num_computed_tokens += num_tokens - len(plan.spec_token_ids.get(req_id, ()))
            if request.spec_token_ids:
                request.spec_token_ids = []  # sent, or dropped for want of room
            if request.num_computed_tokens == request.num_tokens_with_placeholders:
                request.num_output_placeholders += 1  # it samples: its token comes later
        return output

    def _schedule_running(self, plan: StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.token_budget > 0:
            request = self.running[index]
            if request.num_output_placeholders and not self._may_run_ahead(request):
                index += 1  # its in-flight token may finish it, or its grammar needs it first
                continue
            num_known = request.num_tokens_with_placeholders - request.num_computed_tokens
            num_new_tokens = min(num_known + len(request.spec_token_ids), plan.token_budget)
            # A running request always has a token to compute: the one its last step sampled
            # (known or still in flight), or the rest of a prompt being chunked in.
            assert num_new_tokens > 0, request
            new_blocks, num_new_tokens = self._allocate_or_preempt(
                request, num_new_tokens, min(num_known, num_new_tokens), plan
            )
            if new_blocks is None:
                return  # it preempted itself, and with it every request after it
            # The drafts it carries, as many as the budget and the pool left room for.
            drafts = request.spec_token_ids[: max(0, num_new_tokens - num_known)]
            plan.add(request, num_new_tokens, new_blocks, drafts)
            index += 1

    def _may_run_ahead(self, request: Request) -> bool:
        """Whether a request whose sampled tokens are still in flight may be scheduled on top of
        them: not when they may already reach its length limits, and not with a grammar (its
        bitmask needs the matcher to have seen every earlier token)."""
        return (
            not request.use_structured_output
            and request.num_output_tokens + request.num_output_placeholders < request.max_tokens
            and request.num_tokens_with_placeholders < self.max_model_len
        )

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, num_needed: int, plan: StepPlan
    ) -> tuple[KVCacheBlocks | None, int]:
        """Blocks for the request's new tokens, and how many it got: its drafts (the tokens past
        `num_needed`) are dropped before anyone is preempted for them."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks, num_new_tokens
            if num_new_tokens > num_needed:
                num_new_tokens = num_needed
                continue
            # Requests before `request` in `running` are already scheduled this step; the
            # newest is at or after it, so preemption never undoes this step's decisions.
            victim = self.running.pop()
            self._preempt(victim, plan)
            if victim is request:
                return None, 0

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        assert request.request_id not in plan.num_scheduled_tokens
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self._put(self.waiting, request, self.waiting.appendleft)
        self.num_preemptions += 1
        plan.preempted_req_ids.add(request.request_id)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        manager = self.kv_cache_manager
        skipped: list[Request] = []  # requests that must wait, put back in order below
        # The adapters in the workers' slots (no set to build per step without LoRA).
        loras = {r.lora_int_id for r in self.running} - {0} if self.max_loras else set()
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            lora_id = request.lora_int_id
            if (
                request.status == RequestStatus.WAITING_FOR_FSM
                or request.num_output_placeholders
                or (lora_id and lora_id not in loras and len(loras) >= self.max_loras)
            ):
                # A grammar still compiling, preempted with a sampled token in flight, or an
                # adapter while the workers' LoRA slots are all taken by running requests.
                skipped.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
            num_new_tokens = min(request.num_tokens - num_hit_tokens, plan.token_budget)
            new_blocks = manager.allocate_slots(request, num_new_tokens, hit_blocks)
            if new_blocks is None:
                break  # first come first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            if not request.sent_to_workers:
                request.num_cached_tokens = num_hit_tokens
                request.scheduled_ts = time.monotonic()
                plan.new_reqs.append(request)
            else:
                assert request.status == RequestStatus.PREEMPTED
                plan.resumed_req_ids.add(request.request_id)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            self._put(self.running, request, self.running.append)
            if lora_id:
                loras.add(lora_id)
            # The manager's returned blocks exclude the hits; a new or resumed request is sent
            # its whole table anyway.
            plan.add(request, num_new_tokens, new_blocks)
        self.waiting.extendleft(reversed(skipped))

    def _check_grammars(self) -> None:
        """Requests whose grammar compiled become WAITING; a failed or timed-out compile
        finishes its request with "error" (reported by the next update_from_output)."""
        compiling = [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_FSM]
        if not compiling:
            return
        for request in self.structured_output_manager.update_waiting(compiling):
            self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
            self.grammar_error_outputs.append(
                EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR)
            )

    # ---- update ---------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Records one step's sampled tokens and stops. Returns what changed."""
        sampled = dict(zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids))
        logprobs = model_runner_output.logprobs_by_request()
        prompt_logprobs = model_runner_output.prompt_logprobs
        pooled = model_runner_output.pooler_output
        verified, drafts = scheduler_output.scheduled_spec_decode_tokens, {}
        if model_runner_output.spec_token_ids is not None:
            drafts = dict(zip(model_runner_output.req_ids, model_runner_output.spec_token_ids))
        outputs, self.grammar_error_outputs = self.grammar_error_outputs, []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None:
                continue  # finished or aborted after it was scheduled: its token is dropped
            tokens = sampled.get(req_id, [])
            # Workers sample (or pool) only where the scheduler counted a placeholder; a step
            # that verified drafts returns more than one token for it.
            num_filled = bool(tokens) + (req_id in pooled)
            assert request.num_output_placeholders >= num_filled, request
            request.num_output_placeholders -= num_filled
            # Preempted while its step ran: the token still counts; it resumes after it.
            preempted = request.status == RequestStatus.PREEMPTED
            output = self._update_request(
                request,
                tokens,
                logprobs.get(req_id),
                prompt_logprobs.get(req_id),
                pooled.get(req_id),
            )
            if output is not None:
                outputs.append(output)
                if preempted and request.is_finished():
                    self.waiting.remove(request)
            if verified or drafts:
                self.spec_decoding.update(request, verified.get(req_id), tokens, drafts.get(req_id))
        if any(request.is_finished() for request in self.running):
            self.running = [request for request in self.running if not request.is_finished()]
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats())

    def _update_request(
        self,
        request: Request,
        sampled: list[int],
        logprobs: LogprobsLists | None,
        prompt_logprobs: LogprobsLists | None,
        pooled: list[float] | None = None,
    ) -> EngineCoreOutput | None:
        if pooled is not None:
            request.status = RequestStatus.FINISHED_STOPPED  # its prompt is all it needed
        new_token_ids: list[int] = []
        for token_id in sampled:
            request.append_output_token_ids([token_id])
            new_token_ids.append(token_id)
            if check_stop(request, self.max_model_len) or self._advance_grammar(request, token_id):
                break
        if not new_token_ids and prompt_logprobs is None and pooled is None:
            return None
        if request.is_finished():
            self._free_request(request)
        # The first output with tokens (a prompt-logprobs chunk before it has none).
        first = bool(new_token_ids) and request.num_output_tokens == len(new_token_ids)
        first = first or pooled is not None
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.get_finish_reason(),
            stop_reason=request.stop_reason,
            new_logprobs=None if logprobs is None else logprobs.rows(0, len(new_token_ids)),
            new_prompt_logprobs=prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens,
            queued_ts=request.queued_ts if first else 0.0,
            scheduled_ts=request.scheduled_ts if first else 0.0,
            pooling_output=pooled,
        )

    def _advance_grammar(self, request: Request, token_id: int) -> bool:
        """Feeds the sampled token to the request's matcher; True if that finished it."""
        if not request.use_structured_output:
            return False
        status = self.structured_output_manager.accept_token(request, token_id)
        if status is not None:
            request.status = status
        return status is not None

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finishes requests from outside the step (abort). Unknown or finished ids are ignored:
        an abort may race with the request's own completion."""
        assert status.is_finished(), status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        assert request.is_finished()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    # ---- maintenance and stats ------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        prefix_stats = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_prefix_cache_query_tokens=prefix_stats.num_query_tokens,
            num_prefix_cache_hit_tokens=prefix_stats.num_hit_tokens,
            num_preemptions=self.num_preemptions,
            **(self.spec_decoding.stats() if self.spec_decoding.num_drafts else {}),
            **(adapter_counts(self.running, self.waiting) if self.max_loras else {}),
        )
