"""Worker: one device's share of the model, driven by the executor through collective_rpc.

Start-up, in the order the executor and the core call it:
`init_device` (device, CPU threads and cores, seed, tensor-parallel group) -> `load_model` ->
`get_kv_cache_spec` -> `determine_available_memory` (profiling forward) ->
`initialize_from_config` (allocate + bind the KV cache) -> `compile_or_warm_up_model`.
Then `execute_model` once per scheduler step. The model work itself lives in `GPUModelRunner`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from v1engine.kv_cache_interface import KVCacheConfig, KVCacheSpec
from v1engine.logger import info_once, init_logger
from v1engine.model.hf_config import get_architecture, load_hf_config, resolve_dtype
from v1engine.model.layers.linear import LinearBase
from v1engine.model.loader import load_checkpoint
from v1engine.model.parallel_state import destroy_distributed, init_distributed
from v1engine.outputs import ModelRunnerOutput, SchedulerOutput
from v1engine.utils import GiB_bytes
from v1engine.worker.cpu_malloc import tune_malloc_for_tensors
from v1engine.worker.cpu_threads import (
    CpuThreadGovernor,
    contended_step_tokens,
    cpu_thread_governor,
    init_cpu_threads,
)
from v1engine.worker.gpu_model_runner import GPUModelRunner
from v1engine.worker.kv_cache import kv_cache_spec_from_config
from v1engine.worker.memory import (
    CPU_PROFILE_TOKENS,
    MemoryProfile,
    profile_cpu,
    profile_cuda,
)
from v1engine.worker.profiler import WorkerProfiler
from v1engine.worker.sleep_mode import WorkerSleep
from v1engine.worker.worker_base import WorkerBase

logger = init_logger(__name__)

# Per worker, when kv_cache_memory_bytes is unset (see determine_available_memory).
CPU_DEFAULT_KV_CACHE_BYTES = 4 * GiB_bytes


class Worker(WorkerBase):
    """The built-in worker: runs `config.model_config.model` on `cuda:{local_rank}` or the CPU.

    Raises (from `init_device`):
        ValueError: no model configured, an unsupported architecture, or a dtype the device
            cannot compute in.
        RuntimeError: CUDA was asked for but is unavailable, or has too few devices.
    """

    def __init__(
        self,
        config: Any,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        super().__init__(config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.device: torch.device | None = None
        self.model_runner: GPUModelRunner | None = None
        self.memory_profile: MemoryProfile | None = None
        self.cpu_threads: CpuThreadGovernor | None = None
        self.profiler: WorkerProfiler | None = None

    # -- start-up -------------------------------------------------------------------------------
    def init_device(self) -> None:
        model_config = self.config.model_config
        if model_config.model is None:
            raise ValueError(
                "the built-in v1engine Worker needs a model, but model_config.model is None; "
                "pass model=<HF directory or .gguf file>, or set worker_cls to your own "
                "WorkerBase subclass for RPC-only use"
            )
        hf_config = model_config.hf_config
        if hf_config is None:  # a ModelConfig built by hand rather than by EngineArgs
            hf_config = load_hf_config(model_config.model, model_config.trust_remote_code)
        get_architecture(hf_config)  # fail before joining the group, naming supported ones
        world_size = self.config.parallel_config.world_size
        device_type = self.config.device_config.device_type
        if device_type == "cuda":
            self.device = _init_cuda_device(self.local_rank, world_size)
        else:
            self.device = torch.device("cpu")
            init_cpu_threads(self.local_rank, local_world_size(world_size))
            tune_malloc_for_tensors()
        check_dtype_supported(
            resolve_dtype(hf_config, model_config.dtype, device_type), self.device
        )
        torch.manual_seed(model_config.seed)
        init_distributed(
            self.rank,
            world_size,
            self.distributed_init_method,
            backend="nccl" if device_type == "cuda" else "gloo",
        )
        self.model_runner = GPUModelRunner(
            self.config, hf_config, self.device, is_driver=self.is_driver_worker
        )
        self.sleep_mode = WorkerSleep(self.model_runner)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def reload_weights(self) -> None:
        """vLLM's: reads the checkpoint into the running model again, in place (`LLM(...,
        load_format="dummy")` then `llm.collective_rpc("reload_weights")`). Prefixes cached
        before were computed by the old weights: call `reset_prefix_cache()` after it. The
        copies derived from the weights follow before the next step (derived_weights.py)."""
        load_checkpoint(self.model_runner.model, self.config.model_config.model)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_spec()

    @classmethod
    def kv_cache_spec_from_config(cls, config: Any) -> dict[str, KVCacheSpec] | None:
        # A subclass that reports or sizes its cache its own way cannot be predicted.
        own_sizing = any(
            getattr(cls, name) is not getattr(Worker, name)
            for name in ("get_kv_cache_spec", "determine_available_memory")
        )
        if own_sizing or config.model_config.hf_config is None:
            return None
        return kv_cache_spec_from_config(config)

    def determine_available_memory(self) -> int:
        """Bytes this rank can give the KV cache (see `memory.py` for the method);
        `cache_config.kv_cache_memory_bytes` replaces the measurement when set."""
        cache_config = self.config.cache_config
        utilization = cache_config.gpu_memory_utilization
        if self.device.type == "cuda":
            profile = profile_cuda(self.model_runner.profile_run, self.device, utilization)
        else:
            world_size = self.config.parallel_config.world_size
            weights_bytes = self.model_runner.weights_bytes
            profile = profile_cpu(
                lambda mark: self.model_runner.profile_run(CPU_PROFILE_TOKENS, mark),
                weights_bytes,
                utilization,
                world_size,
            )
        self.memory_profile = profile
        info_once(logger, "Memory profile (%s): %s", self.device, profile.describe())
        if cache_config.kv_cache_memory_bytes is not None:
            info_once(
                logger,
                "kv_cache_memory_bytes=%d replaces the measured %d bytes",
                cache_config.kv_cache_memory_bytes,
                profile.available_kv_bytes,
            )
            return cache_config.kv_cache_memory_bytes
        if self.device.type == "cpu" and profile.available_kv_bytes > CPU_DEFAULT_KV_CACHE_BYTES:
            # Zero-filling most of the host's RAM takes minutes and starves everything else;
            # like vLLM's CPU backend, default to a fixed KV space and let users ask for more.
            info_once(
                logger,
                "CPU KV cache capped at %.1f GiB of the %.1f GiB measured; set "
                "kv_cache_memory_bytes to use more",
                CPU_DEFAULT_KV_CACHE_BYTES / GiB_bytes,
                profile.available_kv_bytes / GiB_bytes,
            )
            return CPU_DEFAULT_KV_CACHE_BYTES
        return profile.available_kv_bytes

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> None:
        self.model_runner.warm_up()
        if self.device.type == "cuda" and not self.config.model_config.enforce_eager:
            if not type(self.model_runner.model).supports_cuda_graphs:
                info_once(logger, "A mixture of experts is not captured in CUDA graphs")
            elif self.config.parallel_config.world_size == 1:
                self.model_runner.capture_cuda_graphs()
            else:
                # torch.distributed's all-reduce inside a captured graph has not run here yet.
                info_once(
                    logger,
                    "CUDA graphs are captured at tensor_parallel_size 1 only; running eagerly",
                )
        # The warm-up drew random numbers; restart so unseeded sampling follows the seed alone.
        torch.manual_seed(self.config.model_config.seed)
        if self.device.type == "cpu":  # the thread count is final here, a subclass's included
            runner = self.model_runner
            linears = (m for m in runner.model.modules() if isinstance(m, LinearBase))
            widths = {m.weight.shape[1] for m in linears}  # each matmul's in_features
            self.cpu_threads = cpu_thread_governor(contended_step_tokens(runner.dtype, widths))

    # -- serving --------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.cpu_threads is not None:
            self.cpu_threads.before_step(scheduler_output.total_num_scheduled_tokens)
        return self.model_runner.execute_model(scheduler_output)

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> str | None:
        """Starts (`is_start`) or stops this rank's torch.profiler session (worker/profiler.py);
        a stop returns the trace's path. Raises RuntimeError when the engine's profiler_config
        has no profiler, or for a start while one runs or a stop while none does."""
        if self.profiler is None:
            config = self.config.profiler_config
            config.require_on()
            self.profiler = WorkerProfiler(config, self.rank, self.device)
        if is_start:
            self.profiler.start(profile_prefix)
            return None
        return self.profiler.stop()

    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode (worker/sleep_mode.py): drops the KV cache, and the weights to host
        memory (level 1) or entirely (level 2). Returns the bytes freed."""
        return self.sleep_mode.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Takes back the memory of `tags` ("weights", "kv_cache"; both when None)."""
        self.sleep_mode.wake_up(tags)

    def check_health(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # surfaces an asynchronous device fault

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.shutdown()
        destroy_distributed()


def check_dtype_supported(dtype: torch.dtype, device: torch.device) -> None:
    """Raises ValueError when `device` cannot run the model's matmuls in `dtype`."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        capability = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"dtype=bfloat16 is not supported by {name} (compute capability {capability}); "
            "pass dtype='float16' or dtype='float32'"
        )
    try:
        probe = torch.ones(4, 4, dtype=dtype, device=device)
        (probe @ probe).sum().item()
    except RuntimeError as e:
        raise ValueError(
            f"dtype={str(dtype).removeprefix('torch.')} cannot run matmuls on {device} ({e}); "
            "pass dtype='float32'"
        ) from e


def _init_cuda_device(local_rank: int, world_size: int) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "device='cuda' but torch sees no CUDA device (torch "
            f"{torch.__version__}); pass device='cpu' or install a CUDA build of torch"
        )
    num_devices = torch.cuda.device_count()
    if local_rank >= num_devices:
        raise RuntimeError(
            f"tensor_parallel_size={world_size} needs {world_size} GPUs on this node but "
            f"{num_devices} are visible; lower tensor_parallel_size or expose more GPUs "
            "(CUDA_VISIBLE_DEVICES)"
        )
    device = torch.device(f"cuda:{local_rank}")
    torch.cuda.set_device(device)
    torch.cuda.empty_cache()
    return device


# Set in a worker's own process by an executor that spreads ranks over several nodes (Ray). Not
# torchrun's LOCAL_WORLD_SIZE: an engine launched under torchrun must not inherit its meaning.
LOCAL_WORLD_SIZE_ENV = "V1ENGINE_LOCAL_WORLD_SIZE"


def local_world_size(world_size: int) -> int:
    """Ranks on this node: what the executor set in LOCAL_WORLD_SIZE_ENV, else all of them."""
    return int(os.environ.get(LOCAL_WORLD_SIZE_ENV, world_size))
