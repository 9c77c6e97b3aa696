"""Executor: how the engine core reaches its workers, whatever process layout is behind it."""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from v1engine.executor.rpc_call import RpcCall, WorkerMethods

if TYPE_CHECKING:
    from v1engine.config import EngineConfig, ParallelConfig


def get_worker_class(parallel_config: ParallelConfig) -> type:
    """The class each rank builds: `worker_cls`, with `worker_extension_cls` mixed in when set
    (vLLM's way to add RPC methods, e.g. a weight sync, without replacing the worker).

    Raises:
        ValueError: a class that cannot be imported, or an extension whose public names the
            worker class already has (the extension would silently replace a method the engine
            calls, or be silently hidden by it).
    """
    worker_cls = resolve_worker_cls(parallel_config.worker_cls)
    if not parallel_config.worker_extension_cls:
        return worker_cls
    extension = resolve_worker_cls(parallel_config.worker_extension_cls, "worker_extension_cls")
    own_names = set(dir(extension)) - set(dir(object))
    clashes = sorted(n for n in own_names if not n.startswith("__") and hasattr(worker_cls, n))
    if clashes:
        raise ValueError(
            f"worker_extension_cls {parallel_config.worker_extension_cls!r} defines {clashes}, "
            f"which {worker_cls.__qualname__} already has; rename them in the extension"
        )
    name = f"{worker_cls.__name__}With{extension.__name__}"
    return type(name, (worker_cls, extension), {"__module__": worker_cls.__module__})


def resolve_worker_cls(qualname: str, option: str = "worker_cls") -> type:
    """Imports `module.Class`, with an error that names the `option` and says what to fix."""
    module_name, _, cls_name = qualname.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise _cannot_import(qualname, e, option) from e
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{option} {qualname!r}: module {module_name!r} has no class {cls_name!r}")
    return cls


def check_worker_modules(parallel_config: ParallelConfig) -> None:
    """Raises the ValueError `get_worker_class` would for a module that does not exist, without
    running the module (the engine core refuses a typo before it starts any worker)."""
    for option in ("worker_cls", "worker_extension_cls"):
        qualname = getattr(parallel_config, option)
        if not qualname:
            continue
        try:
            found = importlib.util.find_spec(qualname.rpartition(".")[0]) is not None
        except ImportError as e:  # a parent package that does not exist or fails to import
            raise _cannot_import(qualname, e, option) from e
        if not found:
            raise _cannot_import(qualname, "no such module", option)


def _cannot_import(qualname: str, reason: object, option: str) -> ValueError:
    return ValueError(
        f"{option} {qualname!r}: cannot import module {qualname.rpartition('.')[0]!r} "
        f"({reason}); pass a dotted path importable from sys.path"
    )


def build_worker(
    worker_cls: type, config: Any, rank: int, local_rank: int, distributed_init_method: str
) -> Any:
    """Builds `worker_cls` as DESIGN.md promises (keywords), then `init_device()` and
    `load_model()`. On failure the worker's `shutdown()` runs first, so a process that goes on
    (the uniprocess executor's) can build another."""
    worker = worker_cls(
        config=config,
        local_rank=local_rank,
        rank=rank,
        distributed_init_method=distributed_init_method,
        is_driver_worker=rank == 0,
    )
    try:
        worker.init_device()
        worker.load_model()
    except BaseException:
        worker.shutdown()
        raise
    return worker


class Executor(ABC):
    """Drives one worker per rank. Subclasses own the processes and the transport.

    Args:
        config: the engine configuration; `parallel_config.worker_cls` names the worker class.

    Raises:
        RuntimeError: a worker failed to start (the message carries its traceback).
    """

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.parallel_config.distributed_executor_backend
        if backend == "mp":
            from v1engine.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        if backend == "uni":
            from v1engine.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        if backend == "ray":
            try:
                from v1engine.executor.ray_executor import RayExecutor
            except ImportError as e:
                raise ValueError(
                    f"distributed_executor_backend='ray' is unavailable ({e}); it needs Ray "
                    "(pip install 'v1engine[ray]'); use 'mp' on one node"
                ) from e
            return RayExecutor
        raise ValueError(f"unknown distributed_executor_backend {backend!r}")

    @staticmethod
    def kv_cache_spec_before_start(config: EngineConfig) -> dict[str, Any] | None:
        """The KV cache spec each rank will report, from the worker class and the config alone
        (before any worker starts), or None when the worker class cannot say."""
        worker_cls = get_worker_class(config.parallel_config)
        from_config = getattr(worker_cls, "kv_cache_spec_from_config", None)
        return None if from_config is None else from_config(config)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.parallel_config.world_size
        # What calls may name, from the started workers: the worker class is imported where the
        # workers run, not here (its module imports torch, ~1.3 s the workers would wait for).
        self.worker_methods: WorkerMethods | None = None
        check_worker_modules(config.parallel_config)
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Starts the workers and sets `worker_methods`."""

    def collective_rpc(
        self,
        method: str | Callable,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        non_block: bool = False,
    ) -> Any:
        """Runs `method` on every worker, in the same order on all of them.

        Args:
            method: a public worker method name, or an importable function (module-level, or
                `Class.method`) run as `fn(worker, *args, **kwargs)`; see rpc_call.py.
            timeout: seconds to wait for all replies; None waits forever.
            unique_reply_rank: only this rank's result is returned (the others still report
                errors).
            non_block: return a Future at once instead of the result.

        Returns:
            A list of per-rank results, one result with `unique_reply_rank`, or a Future of
            either with `non_block`.

        Raises:
            ValueError: a method the workers cannot run (nothing is broadcast).
            WorkerError: a worker raised; names every failing rank with its traceback. When
                the failure left other ranks stuck (they did not answer within a grace), the
                worker group is ended too and later calls raise WorkerDiedError
                (group_executor.py's module doc has the rule).
            TimeoutError: no reply within `timeout`; names the method and the silent ranks.
            WorkerDiedError: a worker process exited, or the group was ended.
        """
        return self.run_rpc(RpcCall(method, args, kwargs, timeout, unique_reply_rank), non_block)

    def run_rpc(self, call: RpcCall, non_block: bool = False, lockstep: bool = False) -> Any:
        """`collective_rpc` with the call already built (by EngineCore, or from the wire).

        Args:
            lockstep: the ranks run the call in step, meeting in collectives (a model
                forward), so after one rank's error the others get a short grace to answer
                before they are presumed stuck and the group is ended (group_executor.py's
                module doc).
        """
        call.check(self.worker_methods, self.world_size)
        return self._run_rpc(call, non_block, lockstep)

    @abstractmethod
    def _run_rpc(self, call: RpcCall, non_block: bool, lockstep: bool) -> Any:
        """Runs a checked call on every worker; returns as `collective_rpc` does."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops every worker; idempotent."""

    # -- the engine's view of its workers ---------------------------------------------------
    # The calls that run the model (profiling, warm-up, steps) are lockstep: their ranks meet in
    # the forward's all-reduces, so when one fails the others get only the short grace.
    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        return self.collective_rpc("get_kv_cache_spec")

    def determine_available_memory(self) -> list[int]:
        return self.run_rpc(RpcCall("determine_available_memory"), lockstep=True)

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        # Every worker receives the list and keeps its own entry, so one broadcast suffices.
        self.run_rpc(RpcCall(_initialize_from_configs, (kv_cache_configs,)), lockstep=True)
        self.run_rpc(RpcCall("compile_or_warm_up_model"), lockstep=True)

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        call = RpcCall("execute_model", (scheduler_output,), unique_reply_rank=0)
        return self.run_rpc(call, non_block, lockstep=True)

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _initialize_from_configs(worker: Any, kv_cache_configs: list[Any]) -> None:
    worker.initialize_from_config(kv_cache_configs[worker.rank])
