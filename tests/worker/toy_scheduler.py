"""A toy scheduler that builds `SchedulerOutput`s by hand for worker tests.

It follows the real contract (see `v1engine/outputs.py`): token budget per step, chunked
prefill, new requests sent whole and running ones as diffs, output tokens sent back through
`new_token_ids`, a request arriving with a cached prefix (its first blocks shared with an earlier
request that computed them), preemption with recomputation, and requests left unscheduled for a
step. Block ids come from one shuffled pool shared by all KV cache groups (never reused, so a
finished request's blocks still hold its prefix), and block 0 is never handed out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from v1engine.outputs import (
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from v1engine.sampling_params import SamplingParams


@dataclass
class ToyRequest:
    req_id: str
    prompt: list[int]
    sampling_params: SamplingParams = field(
        default_factory=lambda: SamplingParams(temperature=0.0, max_tokens=5)
    )
    # Prefix-cache hit: the first `num_cached_tokens` tokens are already in `prefix_from`'s
    # first blocks (a multiple of every group's block size).
    num_cached_tokens: int = 0
    prefix_from: str | None = None
    output: list[int] = field(default_factory=list)
    # Per sampled token: the logits it was sampled from ([vocab_size]), when recorded.
    logits: list[torch.Tensor] = field(default_factory=list)
    logprobs: list[tuple[list[int], list[float], int]] = field(default_factory=list)
    num_computed: int = 0
    unsent: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting, running, preempted, resuming, finished

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class ToyScheduler:
    def __init__(
        self, block_sizes: list[int], num_blocks: int, token_budget: int, seed: int = 0
    ) -> None:
        self.block_sizes = block_sizes
        self.free_blocks = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.token_budget = token_budget
        self.requests: dict[str, ToyRequest] = {}
        self.tables: dict[str, list[list[int]]] = {}
        # Tables of finished requests: never freed, so later requests can hit their prefix.
        self._kept_tables: dict[str, list[list[int]]] = {}
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        self.paused: set[str] = set()  # running requests skipped in the next step

    def add(self, request: ToyRequest) -> None:
        self.requests[request.req_id] = request

    def preempt(self, req_id: str) -> None:
        request = self.requests[req_id]
        assert request.status == "running", request.status
        request.status = "preempted"
        request.num_computed = 0  # recomputed from scratch on resumption
        del self.tables[req_id]
        self._preempted_ids.add(req_id)

    def has_unfinished(self) -> bool:
        return any(r.status != "finished" for r in self.requests.values())

    def _allocate(self, req_id: str, num_tokens: int) -> tuple[list[int], ...]:
        table = self.tables[req_id]
        new_ids: list[list[int]] = []
        for ids, block_size in zip(table, self.block_sizes):
            new = []
            while len(ids) * block_size < num_tokens:
                new.append(self.free_blocks.pop())
                ids.append(new[-1])
            new_ids.append(new)
        return tuple(new_ids)

    def _start(self, request: ToyRequest) -> None:
        request.num_computed = request.num_cached_tokens
        if request.prefix_from is None:
            self.tables[request.req_id] = [[] for _ in self.block_sizes]
            return
        source = self.tables.get(request.prefix_from) or self._kept_tables[request.prefix_from]
        self.tables[request.req_id] = [
            list(ids[: request.num_cached_tokens // bs])
            for ids, bs in zip(source, self.block_sizes)
        ]

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(
            finished_req_ids=self._finished_ids, preempted_req_ids=self._preempted_ids
        )
        self._finished_ids, self._preempted_ids = set(), set()
        budget = self.token_budget
        for request in self.requests.values():
            if budget == 0:
                break
            if request.status in ("finished", "preempted") or request.req_id in self.paused:
                continue
            if request.status == "waiting":
                self._start(request)
            elif request.status == "resuming":
                self.tables[request.req_id] = [[] for _ in self.block_sizes]
            num_new = min(len(request.tokens) - request.num_computed, budget)
            new_block_ids = self._allocate(request.req_id, request.num_computed + num_new)
            self._add_to_output(output, request, new_block_ids)
            output.num_scheduled_tokens[request.req_id] = num_new
            budget -= num_new
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        self.paused = set()
        for request in self.requests.values():
            if request.status == "preempted":
                request.status = "resuming"  # may come back from the next step on
        return output

    def _add_to_output(
        self, output: SchedulerOutput, request: ToyRequest, new_block_ids: tuple[list[int], ...]
    ) -> None:
        if request.status == "waiting":
            table = tuple(list(ids) for ids in self.tables[request.req_id])
            output.scheduled_new_reqs.append(
                NewRequestData(
                    request.req_id,
                    list(request.prompt),
                    request.sampling_params,
                    table,
                    request.num_computed,
                )
            )
        else:
            resumed = request.status == "resuming"
            if resumed:
                new_block_ids = tuple(list(ids) for ids in self.tables[request.req_id])
            cached = output.scheduled_cached_reqs
            cached.req_ids.append(request.req_id)
            cached.resumed_from_preemption.append(resumed)
            cached.new_token_ids.append(request.unsent)
            cached.new_block_ids.append(new_block_ids if any(new_block_ids) or resumed else None)
            cached.num_computed_tokens.append(request.num_computed)
        request.unsent = []
        request.status = "running"

    def update(
        self, output: SchedulerOutput, result: ModelRunnerOutput, logits: torch.Tensor | None
    ) -> None:
        """Applies one step's result; `logits` [num_sampled, vocab] are recorded per token."""
        assert sorted(result.req_ids) == sorted(output.num_scheduled_tokens)
        row = 0
        for req_id, sampled in zip(result.req_ids, result.sampled_token_ids):
            request = self.requests[req_id]
            request.num_computed += output.num_scheduled_tokens[req_id]
            if not sampled:
                assert request.num_computed < len(request.tokens), req_id
                continue
            assert request.num_computed == len(request.tokens), req_id
            request.output += sampled
            request.unsent += sampled
            if logits is not None:
                request.logits.append(logits[row])
            if result.logprobs is not None:
                lp = result.logprobs
                request.logprobs.append(
                    (lp.token_ids[row], lp.logprobs[row], lp.sampled_token_ranks[row])
                )
            row += 1
            if len(request.output) >= request.sampling_params.max_tokens:
                self._finish(request)

    def _finish(self, request: ToyRequest) -> None:
        request.status = "finished"
        self._kept_tables[request.req_id] = self.tables.pop(request.req_id)
        self._finished_ids.add(request.req_id)

    def flush(self) -> SchedulerOutput:
        """A step that only reports the last finished requests (the workers drop them)."""
        output = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        return output
