"""EngineArgs: the flat, user-facing configuration. Every field is a `serve` CLI flag."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any

from v1engine.config import (
    CACHE_DTYPES,
    DEFAULT_WORKER_CLS,
    DEVICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPE_ALIASES,
    LOAD_FORMATS,
    LOGPROBS_MODES,
    MODEL_DTYPES,
    RUNNER_TYPES,
    SCHEDULING_POLICIES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    ProfilerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

_CHOICES = {
    "device": DEVICES,
    "dtype": MODEL_DTYPES + tuple(DTYPE_ALIASES),
    "kv_cache_dtype": CACHE_DTYPES,
    "distributed_executor_backend": DISTRIBUTED_EXECUTOR_BACKENDS,
    "scheduling_policy": SCHEDULING_POLICIES,
    "runner": RUNNER_TYPES,
    "logprobs_mode": LOGPROBS_MODES,
    "load_format": LOAD_FORMATS,
}

# vLLM's short forms.
_SHORT_FLAGS = {"tensor_parallel_size": ("-tp",)}


# What each flag does, for `--help` (and the reader of EngineArgs): one entry per field.
_HELP = {
    "model": "an HF checkpoint directory or a .gguf file (default: the embedded "
    "SmolLM2-135M-Instruct)",
    "tokenizer": "the tokenizer's directory (default: the model's)",
    "load_format": "auto (the model's safetensors, or its .gguf), safetensors, gguf, or dummy "
    "(random weights, read nothing: to measure speed, or to receive weights later)",
    "tensor_parallel_size": "workers (devices) the model is split over",
    "device": "where the workers run (auto: CUDA when torch sees a GPU, else the CPU)",
    "dtype": "the model's dtype (auto: bfloat16 on CPUs that compute in it natively, else "
    "float32; on CUDA the checkpoint's 16-bit dtype, else bfloat16; half and float: float16 "
    "and float32)",
    "max_model_len": "the context length, prompt and output (default: the model's); 32k is "
    "32000, 32K 32768",
    "block_size": "tokens per KV cache block",
    "kv_cache_dtype": "the KV cache's dtype (auto: the model's)",
    "gpu_memory_utilization": "the share of the device's memory the engine may use",
    "kv_cache_memory_bytes": "the KV cache's bytes per worker instead of what profiling "
    "leaves (default on CPU: 4 GiB)",
    "num_gpu_blocks_override": "the number of KV cache blocks instead of what profiling leaves",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "most tokens in one step (default: 2048 or max_num_seqs, the "
    "larger); longer prompts are prefilled in chunks",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes computed before",
    "async_scheduling": "schedule each step while the workers run the one before",
    "scheduling_policy": "fcfs, or priority (requests carry a priority, lower served first)",
    "distributed_executor_backend": "mp: a process per worker; uni: one worker in the engine "
    "core's process; ray: Ray actors, across nodes",
    "worker_cls": "the worker class (module.Class), e.g. a WorkerBase subclass of your own",
    "worker_extension_cls": "a class (module.Class) whose methods are added to the worker's, "
    "for collective_rpc to call (e.g. a weight sync)",
    "enable_sleep_mode": "allow sleep() / wake_up(), which give back the memory of the KV cache "
    "and the weights between uses (the server's /sleep and /wake_up, in dev mode)",
    "seed": "the seed of the random numbers unseeded requests sample with",
    "enforce_eager": "no CUDA graphs",
    "trust_remote_code": "run the checkpoint's own Python (its config.json's auto_map)",
    "generation_config": "sampling defaults: auto (the model's generation_config.json), vllm "
    "(none), or a folder with such a file",
    "override_generation_config": "a JSON object of generation_config.json keys (temperature, "
    "top_p, top_k, min_p, repetition_penalty, max_new_tokens) set over those",
    "hf_overrides": "a JSON object set over the checkpoint's config.json (e.g. "
    '{"max_position_embeddings": 4096})',
    "disable_log_stats": "no periodic stats line (the server's /metrics still counts); for LLM, "
    "whose default it is, also no metrics: False enables LLM.get_metrics()",
    "runner": "generate, or pooling (embeddings and classification); auto picks by the checkpoint",
    "enable_lora": "serve LoRA adapters (--lora-modules, /v1/load_lora_adapter)",
    "max_loras": "most LoRA adapters in one step",
    "max_lora_rank": "largest LoRA rank served",
    "max_cpu_loras": "LoRA adapters each worker keeps loaded (default: max_loras)",
    "max_logprobs": "most logprobs and prompt logprobs per token a request may ask for (-1: no "
    "limit, and a request may ask for -1, the whole vocabulary)",
    "logprobs_mode": "what logprobs hold: the model's (raw_logprobs, raw_logits) or those the "
    "sampler drew from (processed_logprobs, processed_logits)",
    "speculative_config": 'a JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
    '"prompt_lookup_max": 4}: verify that many tokens drafted from earlier text each decode step '
    "(config.SpeculativeConfig; turns async scheduling off)",
    "profiler_config": 'a JSON object, e.g. {"profiler": "torch", "torch_profiler_dir": '
    '"./traces"}, to serve /start_profile and /stop_profile (config.ProfilerConfig)',
}


@dataclass
class EngineArgs:
    """The flat, user-facing configuration: each field is a `serve` flag, `_HELP` says what it
    does; `create_engine_config` checks and groups them into the frozen EngineConfig."""

    model: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"  # config.LOAD_FORMATS
    enable_sleep_mode: bool = False
    tensor_parallel_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # vLLM's name for CacheConfig.cache_dtype
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    async_scheduling: bool = True
    scheduling_policy: str = "fcfs"
    distributed_executor_backend: str = "mp"
    worker_cls: str = DEFAULT_WORKER_CLS
    worker_extension_cls: str = ""
    seed: int = 0
    enforce_eager: bool = False
    trust_remote_code: bool = False
    generation_config: str = "auto"  # engine/generation_defaults.py
    override_generation_config: dict[str, Any] | None = None
    hf_overrides: dict[str, Any] | None = None  # for the engine and its workers alike
    disable_log_stats: bool = False  # engine/stat_logger.py; LLM's default is True
    runner: str = "auto"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"  # config.LOGPROBS_MODES
    profiler_config: dict[str, Any] | ProfilerConfig | None = None  # worker/profiler.py
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None  # worker/spec_decode.py

    def create_engine_config(self) -> EngineConfig:
        """Builds the frozen EngineConfig. Reads a model's config files (never its weights)."""
        model_config = self._model_config()
        hf_config, max_model_len = model_config.hf_config, model_config.max_model_len
        max_num_batched_tokens = self.max_num_batched_tokens or max(2048, self.max_num_seqs)
        speculative_config = self._speculative_config(model_config.runner_type)
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                cache_dtype=self.kv_cache_dtype,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                worker_cls=self.worker_cls,
                worker_extension_cls=self.worker_extension_cls,
            ),
            scheduler_config=SchedulerConfig(
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                async_scheduling=self.async_scheduling,  # off with speculative decoding
                policy=self.scheduling_policy,
            ),
            device_config=DeviceConfig(device=self.device),
            lora_config=self._lora_config(model_config.runner_type),
            profiler_config=(
                self.profiler_config
                if isinstance(self.profiler_config, ProfilerConfig)
                else ProfilerConfig.from_dict(self.profiler_config)
            ),
            speculative_config=speculative_config,
        )
        if hf_config is not None:
            from v1engine.model.hf_config import check_tensor_parallel_shape, get_architecture

            get_architecture(hf_config)  # an unsupported architecture fails here, in-process
            check_tensor_parallel_shape(hf_config, self.tensor_parallel_size)
        return config

    def _speculative_config(self, runner_type: str) -> SpeculativeConfig | None:
        """Raises ValueError for a bad speculative_config, or one on a pooling engine."""
        config = self.speculative_config
        if not isinstance(config, SpeculativeConfig):
            config = SpeculativeConfig.from_dict(config)
        if config is not None and runner_type == "pooling":
            raise ValueError(
                "speculative_config drafts generated tokens, and this engine pools (embeddings "
                "or classification); drop it"
            )
        return config

    def _lora_config(self, runner_type: str) -> LoRAConfig | None:
        """Raises ValueError for LoRA on a pooling engine (`runner_type`: "pooling" asked for,
        or "auto" resolved to it for an embedding or classifier checkpoint): its requests
        would run the base model whatever adapter they named."""
        if not self.enable_lora:
            return None
        if runner_type == "pooling":
            raise ValueError(
                "enable_lora serves generation only, and this engine pools (embeddings or "
                "classification); drop --enable-lora"
            )
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _model_config(self) -> ModelConfig:
        """The model's part: its transformers config, the context length resolved against it,
        and the sampling defaults of its generation_config.json."""
        from v1engine.engine.generation_defaults import load_sampling_defaults
        from v1engine.model.hf_config import (
            check_load_format,
            load_hf_config,
            resolve_max_model_len,
            resolve_runner,
        )
        from v1engine.model.quantized_checkpoint import fp8_weights

        if self.runner not in RUNNER_TYPES:
            raise ValueError(f"runner must be one of {RUNNER_TYPES}, got {self.runner!r}")
        hf_config = None
        max_model_len = self.max_model_len or 2048
        if self.model is not None:
            check_load_format(self.model, self.load_format)
            hf_config = load_hf_config(self.model, self.trust_remote_code, self.hf_overrides)
            fp8_weights(hf_config)  # a quantization it cannot load fails here, named
            max_model_len = resolve_max_model_len(hf_config, self.max_model_len)
        return ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            max_model_len=max_model_len,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            trust_remote_code=self.trust_remote_code,
            hf_config=hf_config,
            generation_config=self.generation_config,
            override_generation_config=self.override_generation_config,
            sampling_defaults=load_sampling_defaults(
                self.generation_config, self.model, self.override_generation_config
            ),
            runner_type=resolve_runner(self.runner, hf_config),
            max_logprobs=self.max_logprobs,
            logprobs_mode=self.logprobs_mode,
            load_format=self.load_format,
            enable_sleep_mode=self.enable_sleep_mode,
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One `--flag-name` per field; booleans get `--flag/--no-flag`."""
        for f in fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if isinstance(default, bool):
                parser.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=default,
                    help=_HELP[f.name] + " (default: %(default)s)",
                )
                continue
            parser.add_argument(
                *_SHORT_FLAGS.get(f.name, ()),
                flag,
                type=_field_type(f),
                default=default,
                choices=_CHOICES.get(f.name),
                help=_HELP[f.name] + ("" if default is None else " (default: %(default)s)"),
            )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Builds EngineArgs, rejecting unknown keys with the list of valid ones."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid ones: {sorted(names)}")
        return cls(**kwargs)


def _field_type(f: dataclasses.Field) -> Any:
    if f.name == "max_model_len":
        return human_readable_int
    # Annotations are strings under `from __future__ import annotations`.
    text = str(f.type)
    if text.startswith("dict"):
        return _json_object
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (argparse turns the ValueError into a usage error naming it)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text!r}")
    return value


_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_readable_int(text: str) -> int:
    """vLLM's reading of `--max-model-len`: an integer, or a number with a suffix, decimal in
    lowercase (25.6k: 25600) and binary in uppercase (1K: 1024); argparse turns the ValueError
    into a usage error naming the flag."""
    text = text.strip()
    if text[-1:] not in _UNITS:
        return int(text)
    value = float(text[:-1]) * _UNITS[text[-1]]
    if not value.is_integer():
        raise ValueError(f"{text!r} is not a whole number of tokens")
    return int(value)
