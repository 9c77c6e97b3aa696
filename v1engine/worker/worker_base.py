"""WorkerBase: the whole RPC surface a worker offers the executor, as explicit methods.

The executor builds `worker_cls(config=..., local_rank=..., rank=..., distributed_init_method=...,
is_driver_worker=...)` in each worker process and, at start-up, calls only `init_device()` and
`load_model()`. Everything else arrives through `collective_rpc(method_name, ...)`: a subclass may
add its own public methods and call them the same way. A worker knows nothing of processes or
queues; it is a plain object whose methods get called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from v1engine.config import EngineConfig


class WorkerBase:
    """Args:
    config: the engine's frozen configuration.
    local_rank: index of this worker's device on its node.
    rank: global rank in the tensor-parallel group (0 is the driver).
    distributed_init_method: torch.distributed rendezvous URL, unique per engine.
    is_driver_worker: True for rank 0, whose results the engine reads.
    """

    def __init__(
        self,
        config: EngineConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        self.config = config
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker

    def init_device(self) -> None:
        """Selects the device and joins the tensor-parallel group. Default: nothing."""

    def load_model(self) -> None:
        """Loads this rank's shard of the weights. Default: nothing."""

    def get_kv_cache_spec(self) -> dict[str, Any]:
        """Returns: layer name -> KVCacheSpec for every attention layer on this rank."""
        raise NotImplementedError(f"{type(self).__name__} does not run a model")

    @classmethod
    def kv_cache_spec_from_config(cls, config: Any) -> dict[str, Any] | None:
        """The `get_kv_cache_spec` every rank will report, known from the config alone (no
        weights), so the engine can check a fixed KV budget before starting any worker; None
        when it is not known before start-up. Default: None."""
        return None

    def determine_available_memory(self) -> int:
        """Returns: bytes this rank can give the KV cache, measured by a profiling forward."""
        raise NotImplementedError(f"{type(self).__name__} does not run a model")

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        """Allocates and binds this rank's KV cache tensors as the KVCacheConfig says."""
        raise NotImplementedError(f"{type(self).__name__} does not run a model")

    def compile_or_warm_up_model(self) -> None:
        """Warms up (and on CUDA captures graphs) once the KV cache exists. Default: nothing."""

    def execute_model(self, scheduler_output: Any) -> Any:
        """Runs one step. Returns: ModelRunnerOutput on the driver, None elsewhere."""
        raise NotImplementedError(f"{type(self).__name__} does not run a model")

    def check_health(self) -> None:
        """Raises if this worker cannot serve. Default: healthy."""

    def shutdown(self) -> None:
        """Releases resources before the process exits. Default: nothing."""
