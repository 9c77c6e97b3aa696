"""How many bytes a worker can give its KV cache, measured around a profiling forward.

CUDA (vLLM's method): budget = device total x gpu_memory_utilization; used = the allocator's
peak during the profiling run (weights + activations) + memory outside torch's allocator (CUDA
context, NCCL and cuBLAS buffers, other processes), read from `torch.cuda.mem_get_info`.

CPU: the host's memory (the cgroup limit when lower) is shared fairly by the local workers:
budget = total x gpu_memory_utilization / world_size; used = this process's peak resident set
during the profiling run (the kernel's high-water mark, VmHWM, reset just before it through
/proc/self/clear_refs), which covers the interpreter, the libraries, the weights and the
activations. The CPU profiles a smaller step, a forward of at most `CPU_PROFILE_TOKENS` tokens
in requests of at least 16 tokens and the sampler over one row per request, and scales what each
stage grew to the largest step: the forward's by tokens, the sampler's by rows. Every
activation of the forward grows at most linearly with the tokens (prefill attention never holds
a [tokens, tokens] matrix), and every tensor of the sampler is [rows, vocab] or smaller, so the
scaled figure is an upper bound. For the default model the whole step (2048 tokens, 128 rows)
took 3.0 s of start-up and grew 449-544 MiB; the smaller one took 0.26 s and gave 565-590 MiB.
The result is also capped at this worker's share of the memory free right now, so other
programs on the host are not pushed out as the cache's pages are committed.

Available = budget - used, never below 0 (the core then explains what to change).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from v1engine.utils import GiB_bytes

CPU_PROFILE_TOKENS = 128

_CGROUP_LIMIT_FILES = (
    "/sys/fs/cgroup/memory.max",  # cgroup v2
    "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # cgroup v1
)


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int  # device memory (CUDA) or host memory (CPU)
    budget_bytes: int  # this worker's share x gpu_memory_utilization
    weights_bytes: int
    activation_peak_bytes: int  # growth above the weights during the profiling run
    # CUDA: memory outside torch's allocator; CPU: the process's interpreter, libraries, heap.
    non_torch_bytes: int
    available_kv_bytes: int

    def describe(self) -> str:
        return (
            f"total {_gib(self.total_bytes)} GiB, budget {_gib(self.budget_bytes)} GiB, "
            f"weights {_gib(self.weights_bytes)} GiB, activation peak "
            f"{_gib(self.activation_peak_bytes)} GiB, non-torch {_gib(self.non_torch_bytes)} GiB"
            f" -> {_gib(self.available_kv_bytes)} GiB ({self.available_kv_bytes} bytes) for "
            "the KV cache"
        )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB_bytes:.3f}"


def host_memory_bytes() -> int:
    """Physical memory this process may use: the host's, or its cgroup's limit when lower."""
    total = psutil.virtual_memory().total
    for path in _CGROUP_LIMIT_FILES:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _read_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def current_rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """The process's resident-set high-water mark since start or the last `reset_peak_rss`."""
    try:
        return _read_status_kib("VmHWM") * 1024
    except (OSError, RuntimeError):
        return current_rss_bytes()


def reset_peak_rss() -> None:
    """Restarts VmHWM at the current RSS. Where the kernel does not allow it, the peak still
    counts the load-time high-water mark: an overestimate that errs safe."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def profile_cpu(
    run: Callable[[Callable[[float], None]], None],
    weights_bytes: int,
    utilization: float,
    world_size: int,
) -> MemoryProfile:
    """Runs `run(after_stage)` (the profiling step, which calls `after_stage(scale)` after its
    forward and after its sampler) and measures this worker's CPU memory around it. Each stage's
    growth is scaled to the largest step (see the module doc), and the two are added: freed
    activations are not reliably reused by the sampler's allocations (a whole 2048-token step
    grew 116 MiB in the forward, then 366 MiB more in the sampler)."""
    rss_before = current_rss_bytes()
    stage_start = rss_before
    activation_peak = 0

    def after_stage(scale: float) -> None:
        nonlocal stage_start, activation_peak
        activation_peak += int(max(0, peak_rss_bytes() - stage_start) * scale)
        stage_start = current_rss_bytes()
        reset_peak_rss()

    reset_peak_rss()
    run(after_stage)
    peak = rss_before + activation_peak
    total = host_memory_bytes()
    budget = int(total * utilization / world_size)
    free_share = int(psutil.virtual_memory().available * utilization / world_size)
    return MemoryProfile(
        total_bytes=total,
        budget_bytes=budget,
        weights_bytes=weights_bytes,
        activation_peak_bytes=activation_peak,
        non_torch_bytes=max(0, rss_before - weights_bytes),
        available_kv_bytes=max(0, min(budget - peak, free_share)),
    )


def profile_cuda(
    run: Callable[[], None], device: torch.device, utilization: float
) -> MemoryProfile:
    """Runs `run` (the profiling forward) and measures the device's memory around it."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    torch_peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    budget = int(total * utilization)
    return MemoryProfile(
        total_bytes=total,
        budget_bytes=budget,
        weights_bytes=weights,
        activation_peak_bytes=torch_peak - weights,
        non_torch_bytes=non_torch,
        available_kv_bytes=max(0, budget - torch_peak - non_torch),
    )
