"""Sleep mode (vLLM's `enable_sleep_mode`): a worker gives back the memory of its weights and KV
cache between uses (say while an RL trainer has the device) and takes it back on waking.

- level 1: the weights are copied to host memory (on CPU they are host memory already, and stay),
  the KV cache is dropped;
- level 2: the weights are dropped too; woken, they hold undefined values until the caller loads
  some (`model.load_weights` from a worker extension, or `reload_weights`).
Waking takes tags: "weights" and "kv_cache", both by default; a woken KV cache is empty. The
weights keep their identity: each storage is resized to nothing and back (as FSDP frees its
shards), so parameters, tied weights and views into them (the greedy screen's LM head) stay
valid. What holds raw addresses is rebuilt: the CPU decoder stack's table follows its caches,
and the CUDA graphs are captured again once both tags are awake.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import repeat
from typing import TYPE_CHECKING

import torch

from v1engine.config import SLEEP_TAGS, check_sleep_args
from v1engine.logger import init_logger
from v1engine.utils import GiB_bytes
from v1engine.worker.cpu_malloc import release_free_heap

if TYPE_CHECKING:
    from v1engine.worker.gpu_model_runner import GPUModelRunner

logger = init_logger(__name__)


class WorkerSleep:
    """The sleep state of one worker's model runner."""

    def __init__(self, runner: GPUModelRunner) -> None:
        self.runner = runner
        self.level = 0  # 0: awake
        self.asleep: set[str] = set()
        # One tensor on each weight storage that was freed, with the storage's bytes.
        self._storages: list[tuple[torch.Tensor, int]] = []
        self._backups: list[torch.Tensor] = []  # level 1 off CPU: the bytes, in host memory
        self._had_cuda_graphs = False

    def sleep(self, level: int) -> int:
        """Frees the KV cache, and the weights as `level` says. Returns the bytes freed."""
        check_sleep_args(level)
        if self.asleep:
            raise RuntimeError(f"the worker is already asleep (level {self.level})")
        runner, freed = self.runner, 0
        self._had_cuda_graphs = runner.cuda_graphs is not None
        kv_bytes = sum(t.size for t in runner.kv_cache_config.kv_cache_tensors)
        runner.release_kv_cache()
        freed += kv_bytes
        if level == 2 or runner.device.type != "cpu":  # on CPU, level 1 keeps the weights
            self._storages = _unique_storages(_weight_tensors(runner))
            if level == 1:
                self._backups = [_host_copy(t) for t, _ in self._storages]
            for tensor, nbytes in self._storages:
                tensor.untyped_storage().resize_(0)
                freed += nbytes
        _release_free_memory(runner.device)
        self.level, self.asleep = level, set(SLEEP_TAGS)
        logger.info("Sleep mode (level %d) freed %.3f GiB", level, freed / GiB_bytes)
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Takes back the memory of `tags` (both when None); waking what is awake does
        nothing."""
        check_sleep_args(tags=tags)
        waking = set(SLEEP_TAGS if tags is None else tags) & self.asleep
        runner = self.runner
        if "weights" in waking:
            for (tensor, nbytes), backup in zip(self._storages, self._backups or repeat(None)):
                tensor.untyped_storage().resize_(nbytes)
                if backup is not None:
                    _bytes_of(tensor).copy_(backup)
            if self.level == 2:  # new values come next: derive the copies from them then
                runner.model.weights_version += 1
            self._storages, self._backups = [], []
        if "kv_cache" in waking:
            runner.initialize_kv_cache(runner.kv_cache_config)
        self.asleep -= waking
        if not self.asleep:
            self.level = 0
            if self._had_cuda_graphs:  # they hold the old addresses of the weights and caches
                runner.capture_cuda_graphs()


def _weight_tensors(runner: GPUModelRunner) -> Iterator[torch.Tensor]:
    yield from runner.model.parameters()
    yield from runner.derived.tensors()


def _unique_storages(tensors: Iterator[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """A tensor on each distinct storage (a tied weight has one), with the storage's bytes."""
    seen: dict[int, tuple[torch.Tensor, int]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            seen.setdefault(storage.data_ptr(), (tensor, storage.nbytes()))
    return list(seen.values())


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under `tensor`, as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of `tensor`'s storage in (pinned, for a fast copy back) host memory."""
    device_bytes = _bytes_of(tensor)
    host = torch.empty(device_bytes.shape, dtype=torch.uint8, pin_memory=True)
    return host.copy_(device_bytes)


def _release_free_memory(device: torch.device) -> None:
    """Gives the freed memory back: to the device, or from this process's heap to the OS."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        release_free_heap()
