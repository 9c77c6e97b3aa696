"""EngineCore: the executor, the scheduler and the KV cache they share, driven one step at a time.

Start-up is the handshake of DESIGN §3, one method per step (`_initialize_kv_caches`): every
worker reports its KV cache specs and spare bytes, the core turns them into one KVCacheConfig per
worker with a common block count, and the workers allocate their caches and warm up. Then each
`step()` schedules a token budget, runs the model once on every worker and turns rank 0's
sampled tokens into per-request outputs; with async scheduling (the default) the workers are
kept one step ahead of the outputs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from v1engine.config import SLEEP_TAGS, EngineConfig, check_sleep_args
from v1engine.core.kv_cache_utils import (
    check_enough_kv_cache_memory,
    get_kv_cache_capacity,
    get_kv_cache_configs,
)
from v1engine.core.scheduler import Scheduler
from v1engine.core.structured_output_manager import StructuredOutputManager
from v1engine.core_protocol import EngineCoreInfo
from v1engine.executor.abstract import Executor
from v1engine.executor.rpc_call import RpcCall
from v1engine.kv_cache_interface import KVCacheConfig
from v1engine.logger import init_logger
from v1engine.outputs import ModelRunnerOutput, SchedulerOutput
from v1engine.request import (
    EngineCoreOutputs,
    EngineCoreRequest,
    Request,
    RequestStatus,
    validate_request,
)
from v1engine.utils import GiB_bytes

logger = init_logger(__name__)

# How long a step with nothing to run waits for a grammar to compile before returning (so the
# engine core's loop reads its input again).
_GRAMMAR_WAIT_S = 0.01
# How long the workers may take to start or stop a profile: a stop writes the traces, which vLLM's
# docs say takes minutes for a long profile of a big model.
PROFILE_RPC_TIMEOUT_S = 1800.0
# How long the workers may take to sleep or wake: copying the weights of a big model to host
# memory and back, or (level 2 then `reload_weights`) nothing slower than loading them.
SLEEP_RPC_TIMEOUT_S = 600.0


class EngineCore:
    """Args:
        config: the engine configuration; `parallel_config` picks the executor and worker class.

    Raises:
        RuntimeError / ValueError: a worker failed to start, or the KV cache does not fit (the
            message says which knob to turn). No worker process is left running.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        check_kv_cache_budget(config)
        self.executor = Executor.get_class(config)(config)
        self._startup_s = {"start workers and load weights": time.perf_counter() - start}
        try:
            kv_cache_config = self._initialize_kv_caches()
        except BaseException:
            self.executor.shutdown()
            raise
        hf_config = config.model_config.hf_config
        self.info = EngineCoreInfo(
            num_blocks=kv_cache_config.num_blocks,
            block_size=config.cache_config.block_size,
            max_model_len=config.scheduler_config.max_model_len,
            vocab_size=getattr(hf_config, "vocab_size", None),
            max_loras=0 if config.lora_config is None else config.lora_config.max_loras,
            max_logprobs=config.model_config.max_logprobs,
        )
        # None for a model-free worker class (validate_request refuses structured outputs).
        self.structured_output_manager = None
        if self.info.vocab_size is not None:
            self.structured_output_manager = StructuredOutputManager(
                config.model_config, self.info.vocab_size
            )
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            kv_cache_config,
            self.structured_output_manager,
            self.info.max_loras,
        )
        # Steps sent to the workers whose outputs are not processed yet, oldest first: one,
        # or two while async scheduling runs the workers a step ahead.
        self._in_flight: deque[tuple[SchedulerOutput, Future]] = deque()
        self._profiling = False  # the workers' torch.profiler sessions run (`profile`)
        self._asleep: set[str] = set()  # the SLEEP_TAGS that `sleep` freed and are not woken
        self._sleep_level = 0
        logger.info(
            "Engine ready in %.2f s (%s)",
            sum(self._startup_s.values()),
            ", ".join(f"{name}: {s:.2f} s" for name, s in self._startup_s.items()),
        )

    # -- start-up ------------------------------------------------------------------------------
    def _initialize_kv_caches(self) -> KVCacheConfig:
        specs = self._timed("get KV cache specs", self.executor.get_kv_cache_specs)
        available = self._timed("profile memory", self.executor.determine_available_memory)
        configs = get_kv_cache_configs(
            self.config.cache_config, self.config.scheduler_config, specs, available
        )
        self._timed("allocate KV caches and warm up", self.executor.initialize_from_config, configs)
        self._log_kv_cache(configs[0], available)
        return configs[0]

    def _timed(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args)
        self._startup_s[name] = time.perf_counter() - start
        return result

    def _log_kv_cache(self, kv_cache_config: KVCacheConfig, available: list[int]) -> None:
        scheduler_config = self.config.scheduler_config
        num_tokens, concurrency = get_kv_cache_capacity(scheduler_config, kv_cache_config)
        kv_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        logger.info(
            "KV cache: %d blocks of %d tokens, %.3f GiB per worker (workers could spare %s GiB), "
            "%d tokens; maximum concurrency for %d-token requests: %.2fx",
            kv_cache_config.num_blocks,
            self.config.cache_config.block_size,
            kv_bytes / GiB_bytes,
            ", ".join(f"{a / GiB_bytes:.3f}" for a in available),
            num_tokens,
            scheduler_config.max_model_len,
            concurrency,
        )

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a request. Raises ValueError (and changes nothing) when it cannot be served."""
        if self._asleep:
            raise ValueError(
                f"the engine is asleep (sleep level {self._sleep_level}); call wake_up() "
                "before adding requests"
            )
        validate_request(request, self.info, self.scheduler.requests)
        max_model_len = self.info.max_model_len
        self.scheduler.add_request(Request.from_engine_core_request(request, max_model_len))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether `step()` has anything to do: unfinished requests, or a step sent to the
        workers whose outputs it has not read yet."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    # -- stepping ------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Returns the outputs of one model step.

        With `async_scheduling` the workers are kept one step ahead: while they run step N, the
        core schedules step N+1 and sends it (the workers queue it), then waits for N's tokens
        and turns them into outputs; N+1 runs as soon as N ends, and its tokens come with the
        next call. A step that would need tokens still in flight (a grammar's bitmask) is
        scheduled only once they arrived (the scheduler's module doc says how)."""
        if not self._in_flight and not self._launch(self.scheduler.schedule()):
            if self.structured_output_manager is not None:
                self.structured_output_manager.wait_for_grammars(
                    self.scheduler.waiting, _GRAMMAR_WAIT_S
                )
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        if self._may_schedule_ahead():
            self._launch(self.scheduler.schedule())
        scheduler_output, future = self._in_flight.popleft()
        model_output = future.result()
        if model_output is None or not scheduler_output.total_num_scheduled_tokens:
            model_output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def _launch(self, scheduler_output: SchedulerOutput) -> bool:
        """Sends a step to the workers unless it has nothing for them; True if sent. A step
        with no tokens still goes when it names finished or preempted requests, or the workers
        would keep their state forever."""
        if not (
            scheduler_output.total_num_scheduled_tokens
            or scheduler_output.finished_req_ids
            or scheduler_output.preempted_req_ids
        ):
            return False
        future = self.executor.execute_model(scheduler_output, non_block=True)
        self._in_flight.append((scheduler_output, future))
        return True

    def _may_schedule_ahead(self) -> bool:
        return (
            self.config.scheduler_config.async_scheduling
            and len(self._in_flight) == 1
            and (self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests())
            # A grammar needs its last token before its next bitmask: no step ahead while one runs.
            and not any(request.use_structured_output for request in self.scheduler.running)
        )

    # -- control -------------------------------------------------------------------------------
    def collective_rpc(
        self,
        method: str | Callable,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        return self.executor.run_rpc(RpcCall(method, args, kwargs, timeout, unique_reply_rank))

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Starts or stops every worker's torch.profiler session (`worker/profiler.py`).

        Raises:
            RuntimeError: profiling is off (no `profiler_config.profiler`), a start while a
                profile runs or a stop while none does; a WorkerError (a RuntimeError) when a
                rank failed, naming it.
        """
        self.config.profiler_config.require_on()
        if is_start == self._profiling:
            raise RuntimeError(
                "a profile is already running; call stop_profile() before starting another"
                if is_start
                else "no profile is running; call start_profile() first"
            )
        call = RpcCall("profile", (is_start, profile_prefix), timeout=PROFILE_RPC_TIMEOUT_S)
        self.executor.run_rpc(call)
        self._profiling = is_start

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (worker/sleep_mode.py): every worker drops its KV cache, and its
        weights to host memory (level 1) or entirely (level 2); the cached prefixes go with the
        cache, and requests are refused until `wake_up`.

        Raises:
            RuntimeError: sleep mode is off, the engine sleeps already, or requests are in
                flight (sleep once they finish, or abort them).
            ValueError: a level other than 1 or 2.
        """
        check_sleep_args(level)
        if not self.config.model_config.enable_sleep_mode:
            raise RuntimeError(
                "sleep mode is off; start the engine with enable_sleep_mode=True "
                "(--enable-sleep-mode)"
            )
        if self._asleep:
            raise RuntimeError(f"the engine is asleep already (level {self._sleep_level})")
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError(
                f"{self.scheduler.get_num_unfinished_requests()} request(s) are in flight; "
                "sleep once they finish, or abort them"
            )
        while self._in_flight or self.scheduler.has_finished_requests():
            self.step()  # the workers learn of the last finished requests before they sleep
        self.scheduler.reset_prefix_cache()
        self.executor.run_rpc(RpcCall("sleep", (level,), timeout=SLEEP_RPC_TIMEOUT_S))
        self._asleep, self._sleep_level = set(SLEEP_TAGS), level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wakes `tags` ("weights", "kv_cache"; both when None): after level 2, wake the
        weights, load some (`reload_weights`, or a worker extension's `load_weights`), then the
        KV cache. Waking what is awake does nothing. Raises ValueError for other tags."""
        check_sleep_args(tags=tags)
        waking = sorted(set(SLEEP_TAGS if tags is None else tags) & self._asleep)
        if waking:
            self.executor.run_rpc(RpcCall("wake_up", (waking,), timeout=SLEEP_RPC_TIMEOUT_S))
            self._asleep.difference_update(waking)

    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block; False (and nothing done) while requests run."""
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()
        self.executor.shutdown()


# -- the KV budget, before any worker starts -----------------------------------------------------
def check_kv_cache_budget(config: EngineConfig) -> None:
    """Checks that a KV budget the user fixed (`kv_cache_memory_bytes`, which the workers then
    report as their spare bytes, or `num_gpu_blocks_override`) holds one max_model_len request,
    before any worker starts: a budget that cannot fit fails in a second, not after loading
    the weights and profiling. It is `check_enough_kv_cache_memory`, the check the handshake
    runs later, on the spec the worker class says it will report from the config alone
    (`Executor.kv_cache_spec_before_start`); a worker class that cannot say is checked by the
    handshake only.

    Raises:
        ValueError: the budget cannot hold one request; names the max_model_len that fits.
    """
    cache_config = config.cache_config
    budget_bytes = cache_config.kv_cache_memory_bytes
    if budget_bytes is None and cache_config.num_gpu_blocks_override is None:
        return  # the workers measure their spare memory: nothing to check before they run
    spec = Executor.kv_cache_spec_before_start(config)
    if spec is None:
        return  # a worker class that sizes its cache its own way: the handshake checks it
    check_enough_kv_cache_memory(
        cache_config,
        config.scheduler_config,
        spec,
        # With only a block override, the check replaces the bytes by override x block bytes.
        budget_bytes if budget_bytes is not None else 0,
    )
