"""Shared helpers for worker tests: configs, the KV cache handshake, functions that run inside
the workers through `collective_rpc`, the real `Scheduler` driving them, and a parity check
against transformers.

Functions taking `worker` first are module-level on purpose: `collective_rpc` imports them by name
in every worker process and calls `fn(worker, *args)`.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from v1engine.config import CacheConfig, EngineConfig, SchedulerConfig
from v1engine.core.kv_cache_utils import get_kv_cache_configs
from v1engine.core.scheduler import Scheduler
from v1engine.engine_args import EngineArgs
from v1engine.executor.abstract import Executor
from v1engine.kv_cache_interface import KVCacheConfig
from v1engine.outputs import ModelRunnerOutput, SchedulerOutput
from v1engine.request import EngineCoreOutputs, Request
from v1engine.sampling_params import SamplingParams

KV_CACHE_BYTES = 4 << 20


def make_engine_config(model: str | None, tp: int = 1, **overrides: Any) -> EngineConfig:
    """A small CPU float32 config; `overrides` are EngineArgs fields."""
    args = dict(
        model=model,
        tensor_parallel_size=tp,
        device="cpu",
        dtype="float32",
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_size=4,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
    )
    args.update(overrides)
    return EngineArgs(**args).create_engine_config()


def run_kv_cache_handshake(executor: Executor) -> list[KVCacheConfig]:
    """specs -> available memory -> get_kv_cache_configs -> initialize_from_config (+ warm-up)."""
    config = executor.config
    specs = executor.get_kv_cache_specs()
    available = executor.determine_available_memory()
    configs = get_kv_cache_configs(config.cache_config, config.scheduler_config, specs, available)
    executor.initialize_from_config(configs)
    return configs


# -- run inside the workers ---------------------------------------------------------------------
def execute_with_logits(
    worker: Any, scheduler_output: SchedulerOutput
) -> tuple[ModelRunnerOutput | None, torch.Tensor | None]:
    """`execute_model`, plus the logits the sampler saw ([num_sampled, vocab] on the CPU, or
    None when nothing sampled). A step the greedy screen samples records the full LM head's
    logits too, computes nothing else differently, and counts in `screened_steps`."""
    model = worker.model_runner.model
    screen = worker.model_runner.derived.greedy_screen
    recorded: list[torch.Tensor] = []

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = type(model).compute_logits(model, hidden)
        recorded.append(logits.cpu().clone())
        return logits

    def screened_argmax(hidden: torch.Tensor) -> torch.Tensor | None:
        compute_logits(hidden)
        worker.screened_steps = screened_steps(worker) + 1
        return type(screen).argmax(screen, hidden)

    model.compute_logits = compute_logits
    if screen is not None:
        screen.argmax = screened_argmax
    try:
        output = worker.execute_model(scheduler_output)
    finally:
        del model.compute_logits
        if screen is not None:
            del screen.argmax
    return output, (recorded[0] if recorded else None)


def screened_steps(worker: Any) -> int:
    """How many steps `execute_with_logits` saw the greedy screen sample."""
    return getattr(worker, "screened_steps", 0)


def num_known_requests(worker: Any) -> tuple[int, int]:
    """(requests with state, rows in the input batch)."""
    runner = worker.model_runner
    return len(runner.states.requests), runner.states.input_batch.num_reqs


def kv_cache_layout(worker: Any) -> dict[str, tuple]:
    """Per layer: key shape, value shape, dtype, K and V data pointers, and whether the
    attention layer holds exactly the runner's cache tensors."""
    runner = worker.model_runner
    layout = {}
    for name, (key, value) in runner.kv_caches.items():
        bound = runner.attn_layers[name].kv_cache
        is_bound = bound is not None and bound[0] is key and bound[1] is value
        layout[name] = (
            tuple(key.shape),
            tuple(value.shape),
            key.dtype,
            key.data_ptr(),
            value.data_ptr(),
            is_bound,
        )
    return layout


def touch_kv_caches(worker: Any) -> tuple[bool, int]:
    """Whether every KV cache value is finite (zeros, or what the warm-up wrote); then writes
    every byte (which commits the pages of a lazily mapped cache) and returns the RSS after."""
    all_finite = True
    for key, value in worker.model_runner.kv_caches.values():
        for cache in (key, value):
            # In small parts: a whole-cache temporary would itself add to the RSS measured.
            all_finite &= all(bool(torch.isfinite(p).all()) for p in cache.view(-1).split(1 << 16))
            cache.view(-1).view(torch.int8).fill_(1)
    return all_finite, rss_bytes(worker)


def rss_bytes(worker: Any) -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def memory_profile(worker: Any) -> Any:
    return worker.memory_profile


def worker_threads(worker: Any) -> tuple[int, list[int], str]:
    return torch.get_num_threads(), sorted(os.sched_getaffinity(0)), str(worker.device)


def worker_spin_count(worker: Any) -> str | None:
    return os.environ.get("GOMP_SPINCOUNT")


def worker_huge_pages(worker: Any) -> tuple[str | None, int]:
    """The worker's GLIBC_TUNABLES, and by how many KiB its transparent huge pages grow when it
    allocates and fills a 64 MiB tensor (glibc maps it, past the mmap threshold)."""
    before = anon_huge_kib()
    tensor = torch.ones(16 * 2**20)
    grown = anon_huge_kib() - before
    del tensor
    return os.environ.get("GLIBC_TUNABLES"), grown


def anon_huge_kib() -> int:
    """This process's anonymous memory in transparent huge pages, in KiB."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def expected_spin_count() -> str | None:
    """What worker_spin_count gives in a worker started from this process: OpenMP barriers spin
    briefly, then sleep (worker_proc.worker_env_defaults says why), unless the user chose."""
    return os.environ.get("GOMP_SPINCOUNT", None if "OMP_WAIT_POLICY" in os.environ else "10000")


# -- driving with the real scheduler -------------------------------------------------------------
# The scheduler's own limits; make_engine_config gives the workers max_model_len=64 and
# max_num_seqs=8, which these must not exceed.
SCHEDULER_MAX_MODEL_LEN = 32
SCHEDULER_MAX_NUM_SEQS = 8
# What `RunRecord.events` can report: the situations the workers' request states must survive.
EVENTS = frozenset({"chunked_prefill", "prefix_hit", "preempted", "resumed", "unscheduled"})

StepFn = Callable[[SchedulerOutput], tuple[ModelRunnerOutput, torch.Tensor | None]]


def make_scheduler(
    kv_cache_config: KVCacheConfig,
    token_budget: int = 10,
    num_blocks_per_group: int | None = None,
    max_model_len: int = SCHEDULER_MAX_MODEL_LEN,
) -> Scheduler:
    """The real Scheduler, prefix caching on, over the workers' KV cache config.

    `token_budget` is its max_num_batched_tokens (small: prompts are chunked). With
    `num_blocks_per_group` it hands out only that many blocks per KV cache group (block 0 aside),
    a subset of the workers' cache, so requests get preempted.
    """
    groups = kv_cache_config.kv_cache_groups
    if num_blocks_per_group is not None:
        num_blocks = num_blocks_per_group * len(groups) + 1
        assert num_blocks <= kv_cache_config.num_blocks, (num_blocks, kv_cache_config.num_blocks)
        kv_cache_config = dataclasses.replace(kv_cache_config, num_blocks=num_blocks)
    return Scheduler(
        SchedulerConfig(max_model_len, token_budget, SCHEDULER_MAX_NUM_SEQS),
        CacheConfig(block_size=groups[0].kv_cache_spec.block_size),
        kv_cache_config,
    )


def make_request(
    req_id: str,
    prompt: list[int],
    max_model_len: int = SCHEDULER_MAX_MODEL_LEN,
    **sampling_kwargs: Any,
) -> Request:
    """A request that stops only at max_tokens (5 unless given), with no EOS; greedy unless
    told otherwise. `max_model_len` must be its scheduler's."""
    sampling_kwargs.setdefault("temperature", 0.0)
    sampling_kwargs.setdefault("max_tokens", 5)
    params = SamplingParams(**sampling_kwargs)
    return Request(req_id, prompt, params, None, max_model_len, arrival_time=0.0)


def executor_step(executor: Executor) -> StepFn:
    def step(scheduler_output: SchedulerOutput):
        return executor.collective_rpc(
            execute_with_logits, args=(scheduler_output,), unique_reply_rank=0
        )

    return step


@dataclasses.dataclass
class RunRecord:
    """What a run saw: every step's SchedulerOutput and, per request id, the logits each sampled
    token was drawn from ([vocab_size] on the CPU, when the step function records them) and its
    logprobs as (token ids, logprobs, rank of the sampled token)."""

    scheduler_outputs: list[SchedulerOutput] = dataclasses.field(default_factory=list)
    logits: defaultdict[str, list[torch.Tensor]] = dataclasses.field(
        default_factory=lambda: defaultdict(list)
    )
    logprobs: defaultdict[str, list[tuple[list[int], list[float], int]]] = dataclasses.field(
        default_factory=lambda: defaultdict(list)
    )

    def add_step(
        self,
        scheduler_output: SchedulerOutput,
        result: ModelRunnerOutput,
        logits: torch.Tensor | None,
        outputs: EngineCoreOutputs,
    ) -> None:
        self.scheduler_outputs.append(scheduler_output)
        sampling = [r for r, tokens in zip(result.req_ids, result.sampled_token_ids) if tokens]
        for row, req_id in enumerate(sampling):
            if logits is not None:
                self.logits[req_id].append(logits[row])
        for output in outputs.outputs:
            lists = output.new_logprobs
            if lists is not None:
                entry = (lists.token_ids[0], lists.logprobs[0], lists.sampled_token_ranks[0])
                self.logprobs[output.request_id].append(entry)

    def events(self) -> set[tuple[str, str]]:
        """(event, request id) for every situation in `EVENTS` that the workers went through,
        read from the SchedulerOutputs alone."""
        events: set[tuple[str, str]] = set()
        in_batch: set[str] = set()
        for output in self.scheduler_outputs:
            for new_req in output.scheduled_new_reqs:
                num_left = len(new_req.prompt_token_ids) - new_req.num_computed_tokens
                if output.num_scheduled_tokens[new_req.req_id] < num_left:
                    events.add(("chunked_prefill", new_req.req_id))
                if new_req.num_computed_tokens > 0:
                    events.add(("prefix_hit", new_req.req_id))
            events |= {("preempted", req_id) for req_id in output.preempted_req_ids}
            cached = output.scheduled_cached_reqs
            for req_id, resumed in zip(cached.req_ids, cached.resumed_from_preemption):
                if resumed:
                    events.add(("resumed", req_id))
            # In the batch last step, neither finished nor preempted, yet not scheduled now.
            scheduled = output.num_scheduled_tokens.keys()
            left_out = in_batch - output.finished_req_ids - output.preempted_req_ids - scheduled
            events |= {("unscheduled", req_id) for req_id in left_out}
            in_batch = set(scheduled)
        return events


def run_requests(
    scheduler: Scheduler,
    step: StepFn,
    arrivals: dict[int, list[Request]],
    budgets: dict[int, int] | None = None,
    max_steps: int = 200,
) -> RunRecord:
    """Steps until every request finished, then once more so the workers drop the last ones.

    `arrivals`: requests added before step i. `budgets`: the token budget of step i instead of
    the scheduler's. The scheduler gives every running request at least one token of a fixed
    budget, so lowering it for one step is the one way to leave running requests unscheduled.
    """
    budgets = budgets or {}
    token_budget = scheduler.max_num_batched_tokens
    record = RunRecord()
    num_steps = 0
    while scheduler.has_unfinished_requests() or any(i >= num_steps for i in arrivals):
        assert num_steps < max_steps, "requests did not finish"
        for request in arrivals.get(num_steps, []):
            scheduler.add_request(request)
        scheduler.max_num_batched_tokens = budgets.get(num_steps, token_budget)
        scheduler_output = scheduler.schedule()
        result, logits = step(scheduler_output)
        outputs = scheduler.update_from_output(scheduler_output, result)
        record.add_step(scheduler_output, result, logits, outputs)
        num_steps += 1
    scheduler.max_num_batched_tokens = token_budget
    result, logits = step(scheduler.schedule())
    assert result.req_ids == [] and logits is None
    return record


def make_prompts(vocab_size: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lens]


def run_mixed_scenario(
    step: StepFn, kv_cache_config: KVCacheConfig, vocab_size: int
) -> tuple[list[Request], RunRecord]:
    """Greedy requests through the real scheduler, driven by its knobs into every situation in
    `EVENTS` with decodes mixed in throughout: a budget of 10 chunks 11- and 17-token prompts;
    "d" arrives sharing "a"'s first 8 tokens (2 blocks of 4) and hits them in the prefix cache;
    12 blocks per group run out, so "d" is preempted and recomputes; a budget of 1 in step 7
    leaves "d" and "e" unscheduled. Asserts all of it happened.
    """
    a, b, c, e = make_prompts(vocab_size, [11, 5, 17, 3])
    extra = make_prompts(vocab_size, [4], seed=1)[0]
    req_a, req_b, req_c = make_request("a", a), make_request("b", b), make_request("c", c)
    req_d, req_e = make_request("d", a[:8] + extra), make_request("e", e)
    arrivals = {0: [req_a, req_b, req_c], 2: [req_d], 4: [req_e]}
    scheduler = make_scheduler(kv_cache_config, token_budget=10, num_blocks_per_group=12)
    record = run_requests(scheduler, step, arrivals, budgets={7: 1})
    assert {event for event, _ in record.events()} == EVENTS, sorted(record.events())
    return [req_a, req_b, req_c, req_d, req_e], record


def check_parity_with_hf(
    hf_model: torch.nn.Module, requests: list[Request], record: RunRecord, atol: float
) -> None:
    """Every sampled token is transformers' greedy choice, and the logits it was sampled from
    match transformers' at that position within `atol`."""
    for request in requests:
        ids = torch.tensor([request.all_token_ids[:-1]])
        with torch.no_grad():
            expected = hf_model(ids).logits[0, request.num_prompt_tokens - 1 :].float()
        ours = torch.stack(record.logits[request.request_id])
        torch.testing.assert_close(ours, expected, atol=atol, rtol=0, msg=request.request_id)
        assert request.output_token_ids == expected.argmax(-1).tolist(), request.request_id
