"""Builds a model on its device and streams safetensors weights into this rank's shards.

Each checkpoint tensor reaches its parameter's `weight_loader` as a lazy `get_slice` handle, so a
rank reads only the rows or columns it owns and never holds the whole model in memory.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from v1engine.logger import init_logger
from v1engine.model.hf_config import classifier_labels, get_architecture, prepare_checkpoint
from v1engine.model.layers.linear import pack_cpu_weights
from v1engine.model.models.registry import (
    get_model_class,
    has_lm_head,
    is_base_model,
    is_classifier,
)
from v1engine.model.parallel_state import get_tp_rank
from v1engine.model.quantized_checkpoint import dequantized, fp8_weights
from v1engine.model.weight_utils import WeightSource

logger = init_logger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_DUMMY_SEED = 1234


def get_weight_files(checkpoint_dir: str) -> list[str]:
    """The safetensors files of a checkpoint: the sharded index's files, or model.safetensors.

    Raises:
        RuntimeError: no weights, or the index names a file that is not there.
    """
    index_path = os.path.join(checkpoint_dir, _INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(checkpoint_dir, name) for name in sorted(set(weight_map.values()))]
        missing = [path for path in files if not os.path.isfile(path)]
        if missing:
            raise RuntimeError(
                f"{index_path} lists weight file(s) that do not exist: {missing}; the checkpoint "
                "download is incomplete, fetch the missing shards"
            )
        return files
    single = os.path.join(checkpoint_dir, _SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise RuntimeError(
        f"no {_SINGLE_FILE} or {_INDEX_FILE} in {checkpoint_dir!r}; v1engine loads safetensors "
        "checkpoints (convert .bin weights with transformers' save_pretrained)"
    )


def iterate_weights(files: list[str]) -> Iterator[tuple[str, WeightSource]]:
    """(name, lazy slice) for every tensor of every file, with a progress bar on rank 0."""
    from safetensors import safe_open
    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing semaphore; one bar per process needs only a
    # thread lock, and a killed worker then leaves no semaphore for the resource tracker.
    tqdm.set_lock(threading.RLock())

    num_tensors = 0
    for path in files:  # headers only: cheap, and gives the bar its total
        with safe_open(path, framework="pt") as f:
            num_tensors += len(f.keys())
    with tqdm(total=num_tensors, desc="Loading weights", disable=get_tp_rank() != 0) as bar:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name)
                    bar.update(1)


def read_tensors(files: list[str], suffix: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint whose name ends with `suffix`, read whole (small ones:
    quantization scales)."""
    from safetensors import safe_open

    tensors = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys() if name.endswith(suffix)})
    return tensors


def load_model(
    model_path: str,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    pooling: bool = False,
    load_format: str = "auto",
) -> nn.Module:
    """The model for `hf_config`, built on `device` in `dtype`, with this rank's weights loaded
    (`pooling`: it only pools, so its LM head gets no packed copy for the CPU gemm).

    `model_path` is an HF directory, or a .gguf file (converted once, see `prepare_checkpoint`).
    `load_format="dummy"` reads no weights: small random values instead, as vLLM's (to measure
    speed, or to receive a trainer's weights later). Raises RuntimeError/ValueError naming the
    missing file or tensor when the checkpoint is bad.
    """
    architecture = get_architecture(hf_config)
    model_cls = get_model_class(architecture)
    device = torch.device(device)
    with torch.device(device):
        model = model_cls(hf_config, dtype, has_lm_head=has_lm_head(architecture))
        if is_classifier(architecture):
            # Replicated on every rank (a few rows): `GPUModelRunner._pool` applies it.
            num_labels = len(classifier_labels(hf_config))
            score = nn.Linear(hf_config.hidden_size, num_labels, bias=False, dtype=dtype)
            model.score = score.requires_grad_(False)
    if load_format == "dummy":
        initialize_dummy_weights(model)
    else:
        load_checkpoint(model, model_path)
    pack_cpu_weights(model, with_lm_head=not pooling)
    model.eval()
    logger.debug("Loaded %s from %s on %s", model_cls.__name__, model_path, device)
    return model


def load_checkpoint(model: nn.Module, model_path: str) -> None:
    """Reads the whole checkpoint at `model_path` into `model`'s parameters, in place.

    Raises:
        ValueError: the checkpoint lacks a tensor the model needs (or has one it lacks).
    """
    checkpoint_dir = prepare_checkpoint(model_path)
    files = get_weight_files(checkpoint_dir)
    weights = iterate_weights(files)
    layout = fp8_weights(model.config)
    if layout is not None:  # FP8 weights, dequantized as they come
        weights = dequantized(weights, read_tensors(files, f".{layout.scale_name}"), layout)
    if is_base_model(get_architecture(model.config)):  # its tensors are the causal `model.*`
        weights = ((_causal_name(name), source) for name, source in weights)
    # Slices are read on CPU and copied into the device parameters shard by shard.
    loaded = model.load_weights(weights)
    missing = set(model.expected_checkpoint_names()) - loaded
    if missing:
        raise ValueError(
            f"checkpoint {checkpoint_dir} lacks {len(missing)} tensor(s) "
            f"{type(model).__name__} needs, e.g. {sorted(missing)[:5]}; is it complete?"
        )


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3) -> None:
    """Every floating-point parameter drawn uniformly from [low, high) by a fixed seed (vLLM's
    range, small enough for finite activations)."""
    generator = torch.Generator(device="cpu").manual_seed(_DUMMY_SEED)
    for param in model.parameters():  # a tied weight once
        if param.is_floating_point():
            # Drawn on CPU in float32: the same values whatever the device and dtype.
            param.copy_(torch.empty(param.shape).uniform_(low, high, generator=generator))
    model.weights_version += 1


def _causal_name(base_name: str) -> str:
    return base_name if base_name.startswith("model.") else f"model.{base_name}"
