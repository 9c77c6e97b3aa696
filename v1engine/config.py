"""Frozen, picklable engine configuration, one dataclass per concern (they travel to workers).

Each class is constructible from keyword defaults alone so pure-logic code can be tested without a
model on disk. `EngineArgs` (the flat, user-facing form) lives in `engine_args.py`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from v1engine.logger import init_logger

# The one list of each choice: the configs validate against them, `EngineArgs` offers them as
# CLI `choices`. Dtypes are torch attribute names; "auto" is resolved by the worker.
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other names for two of them (`--dtype half` is common in its commands).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# The KV cache stores what the model computes in ("auto": the model's dtype); no fp8 yet.
CACHE_DTYPES = MODEL_DTYPES
DEVICES = ("auto", "cpu", "cuda")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "uni", "ray")
# vLLM's: first come, first served, or by each request's priority (lower first), then arrival.
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's --runner: "generate" samples tokens, "pooling" embeds or classifies each prompt
# (pooling_params.py); "auto" generates with a causal LM and pools with a base model or a
# sequence classifier (`hf_config.resolve_runner`).
RUNNER_TYPES = ("auto", "generate", "pooling")
DEFAULT_WORKER_CLS = "v1engine.worker.gpu_worker.Worker"
# vLLM's --logprobs-mode: what a logprob field holds. "raw_*": from the model's logits as they
# come; "processed_*": from the logits the draw used (after the grammar, bias, masks, penalties,
# temperature and top-k / top-p / min-p); "*_logits" the logit values, "*_logprobs" their
# log_softmax (model/layers/sampler.py).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# vLLM's `profiler_config.profiler`: torch.profiler traces (its "cuda", Nsight's capture range,
# is not offered: run the server under `nsys profile` instead).
PROFILERS = (None, "torch")
# vLLM's --load-format: "auto" reads the model's safetensors (or its converted .gguf),
# "safetensors" and "gguf" insist on that kind of file, "dummy" reads no weights (loader.py).
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


# vLLM's sleep mode (worker/sleep_mode.py): what `sleep(level)` frees, what `wake_up(tags)` takes.
SLEEP_LEVELS = (1, 2)
SLEEP_TAGS = ("weights", "kv_cache")


def check_sleep_args(level: int | None = None, tags: list[str] | None = None) -> None:
    """Raises ValueError for a sleep level or wake-up tags that do not exist."""
    _require(
        level is None or (not isinstance(level, bool) and level in SLEEP_LEVELS),
        "sleep level must be 1 (weights to host memory, KV cache dropped) or 2 (both dropped), "
        f"got {level!r}",
    )
    _require(
        tags is None or (isinstance(tags, (list, tuple)) and set(tags) <= set(SLEEP_TAGS)),
        f"wake_up tags must be a list of {list(SLEEP_TAGS)} (None: both), got {tags!r}",
    )


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _require_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """What model runs and how. `model=None` means no model (worker-level RPC only).

    `hf_config` is the checkpoint's transformers config as plain attributes (`HFConfig`, read
    from its config files, never its weights); `max_model_len` is resolved against it by
    `EngineArgs.create_engine_config`.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int = 2048
    seed: int = 0
    enforce_eager: bool = False
    # Runs the checkpoint's own Python (its config.json's `auto_map`: config and tokenizer
    # classes); off unless the user trusts the checkpoint, as in transformers and vLLM.
    trust_remote_code: bool = False
    hf_config: Any = None
    # Where sampling defaults come from ("auto": the model's generation_config.json, "vllm":
    # none, or a folder), and what `EngineArgs.create_engine_config` read there.
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None  # set over the file's values
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    runner_type: str = "generate"  # RUNNER_TYPES but "auto", which EngineArgs resolves
    # vLLM's: the most logprobs (and prompt logprobs) per token a request may ask for; -1: no
    # limit, and a request may ask for -1, the whole vocabulary. The sampler is profiled at it.
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"  # LOGPROBS_MODES
    load_format: str = "auto"  # LOAD_FORMATS
    enable_sleep_mode: bool = False  # vLLM's: `sleep` / `wake_up` (worker/sleep_mode.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        _require_choice("dtype", self.dtype, MODEL_DTYPES)
        _require_choice("load_format", self.load_format, LOAD_FORMATS)
        _require_choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        _require_choice("runner_type", self.runner_type, RUNNER_TYPES[1:])
        _require(self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}")
        _require(
            self.max_logprobs >= -1,
            f"max_logprobs must be >= 0, or -1 for no limit, got {self.max_logprobs}",
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}",
        )
        _require(
            self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
            f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}",
        )
        # Named by both spellings: users set it as EngineArgs.kv_cache_dtype / --kv-cache-dtype.
        _require_choice("cache_dtype (--kv-cache-dtype)", self.cache_dtype, CACHE_DTYPES)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    worker_cls: str = DEFAULT_WORKER_CLS
    # vLLM's: a class whose methods are added to the worker's (executor/abstract.py), so
    # `collective_rpc` can call them; "" for none.
    worker_extension_cls: str = ""

    def __post_init__(self) -> None:
        _require(
            self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}",
        )
        _require_choice(
            "distributed_executor_backend",
            self.distributed_executor_backend,
            DISTRIBUTED_EXECUTOR_BACKENDS,
        )
        _require(
            self.distributed_executor_backend != "uni" or self.tensor_parallel_size == 1,
            "distributed_executor_backend='uni' runs one in-process worker; use 'mp' for "
            f"tensor_parallel_size={self.tensor_parallel_size}",
        )
        _require(
            "." in self.worker_cls,
            f"worker_cls must be a dotted 'module.Class' path, got {self.worker_cls!r}",
        )
        _require(
            not self.worker_extension_cls or "." in self.worker_extension_cls,
            "worker_extension_cls must be a dotted 'module.Class' path, got "
            f"{self.worker_extension_cls!r}",
        )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # Plan step N+1 while the workers run step N (vLLM's async scheduling); see EngineCore.step.
    async_scheduling: bool = True
    policy: str = "fcfs"  # SCHEDULING_POLICIES; see core/scheduler.py

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            _require(value >= 1, f"{name} must be >= 1, got {value}")
        _require_choice("policy", self.policy, SCHEDULING_POLICIES)


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"

    def __post_init__(self) -> None:
        _require_choice("device", self.device, DEVICES)

    @property
    def device_type(self) -> str:
        """'cpu' or 'cuda'; 'auto' picks CUDA when torch sees a GPU."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters (vLLM's names); an engine without one refuses LoRA requests."""

    max_loras: int = 1  # adapters in one step: each worker holds this many slots per projection
    max_lora_rank: int = 16
    # Adapters each worker keeps loaded (on the host) for reuse; None: max_loras.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            _require(value >= 1, f"{name} must be >= 1, got {value}")
        cpu = self.max_cpu_loras
        _require(
            cpu is None or cpu >= self.max_loras,
            f"max_cpu_loras must be >= max_loras ({self.max_loras}), got {cpu}",
        )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class ProfilerConfig:
    """vLLM's `--profiler-config`: with `profiler="torch"`, `LLM.start_profile()` /
    `stop_profile()` (the server's POST /start_profile and /stop_profile) record every worker's
    steps with torch.profiler, and each rank writes a trace Perfetto opens into
    `torch_profiler_dir` (made absolute here: the workers may run elsewhere in the tree)."""

    profiler: str | None = None  # PROFILERS; None: profiling is off
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True  # Python stacks of each op (vLLM's default)
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True

    def __post_init__(self) -> None:
        _require(
            self.profiler in PROFILERS,
            f"profiler_config.profiler must be one of {PROFILERS}, got {self.profiler!r}",
        )
        for f in (f for f in fields(self) if isinstance(f.default, bool)):
            value = getattr(self, f.name)
            _require(
                isinstance(value, bool),
                f"profiler_config.{f.name} must be true or false, got {value!r}",
            )
        if self.profiler is None:
            return
        _require(
            isinstance(self.torch_profiler_dir, str) and bool(self.torch_profiler_dir),
            'profiler_config {"profiler": "torch"} needs "torch_profiler_dir": the folder the '
            "traces are written to",
        )
        folder = os.path.abspath(self.torch_profiler_dir)
        _require(
            not os.path.isfile(folder),
            f"profiler_config.torch_profiler_dir {folder!r} is a file; give a folder (it is "
            "made if missing)",
        )
        object.__setattr__(self, "torch_profiler_dir", folder)

    def require_on(self) -> None:
        """Raises RuntimeError, saying how to turn it on, when profiling is off."""
        if self.profiler is None:
            raise RuntimeError(
                "profiling is off: start the engine with profiler_config={'profiler': 'torch', "
                "'torch_profiler_dir': DIR} (the server: --profiler-config "
                '\'{"profiler": "torch", "torch_profiler_dir": "DIR"}\')'
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> ProfilerConfig:
        """Raises ValueError for a key that is not a field, listing the fields."""
        values = values or {}
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(names))
        _require(not unknown, f"unknown profiler_config key(s) {unknown}; valid ones: {names}")
        return cls(**values)


# vLLM's `speculative_config["method"]`s this engine has: n-gram prompt lookup (the drafts are
# the tokens that followed the earliest earlier occurrence of the sequence's ending; no model).
SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: each decode step also verifies up to `num_speculative_tokens`
    drafted tokens, and keeps those the model agrees with (worker/spec_decode.py). The n-gram
    drafter matches the last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`
    (vLLM's defaults: 5 and 5, or the one given for both)."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.method in SPECULATIVE_METHODS,
            f"speculative_config.method must be one of {SPECULATIVE_METHODS} (draft models, "
            f"EAGLE and MTP are not supported), got {self.method!r}",
        )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            _require(
                value is None or (isinstance(value, int) and not isinstance(value, bool)),
                f"speculative_config.{name} must be an integer, got {value!r}",
            )
        _require(
            self.num_speculative_tokens >= 1,
            'speculative_config needs "num_speculative_tokens" >= 1 (drafted tokens per step), '
            f"got {self.num_speculative_tokens}",
        )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        _require(
            1 <= low <= high,
            "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
            f"{self.prompt_lookup_min} and {self.prompt_lookup_max}",
        )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> SpeculativeConfig | None:
        """None without values. Raises ValueError for a key that is not a field."""
        if not values:
            return None
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(names))
        _require(not unknown, f"unknown speculative_config key(s) {unknown}; valid ones: {names}")
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    lora_config: LoRAConfig | None = None  # None: LoRA requests are refused
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)
    speculative_config: SpeculativeConfig | None = None  # None: one token per decode step

    def __post_init__(self) -> None:
        if self.speculative_config is not None and self.scheduler_config.async_scheduling:
            # A step's drafts come back with its tokens: the next step cannot be planned before.
            scheduler_config = replace(self.scheduler_config, async_scheduling=False)
            object.__setattr__(self, "scheduler_config", scheduler_config)
            init_logger(__name__).info(
                "Speculative decoding schedules each step after the last one's tokens: async "
                "scheduling is off"
            )
