"""One worker's torch.profiler session, between the engine's `start_profile` and `stop_profile`.

With `profiler_config={"profiler": "torch", "torch_profiler_dir": DIR}` each rank records what it
runs (the ops of every step, on the CPU and, on CUDA, on the device) and, when the profile stops,
writes into DIR:
- `[PREFIX_]rank<R>.<ms>.pt.trace.json.gz`: the timeline (ui.perfetto.dev opens it gzipped);
- `[PREFIX_]rank<R>.<ms>.txt`: the ops by self time, the table to read first.
Writing a long profile takes a while (seconds per thousand steps here), hence the stop's long
deadline in the engine core.
"""

from __future__ import annotations

import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from v1engine.config import ProfilerConfig
from v1engine.logger import init_logger

logger = init_logger(__name__)

# Rows of the summary table: enough to see every op kind of a decoder layer.
_TABLE_ROWS = 60


class WorkerProfiler:
    """Args:
    config: the engine's profiler config (its `profiler` is "torch").
    rank: this worker's rank, in the trace files' names.
    device: the worker's device; on CUDA the device's kernels are recorded too.
    """

    def __init__(self, config: ProfilerConfig, rank: int, device: torch.device) -> None:
        self.config = config
        self.rank = rank
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self._session: profile | None = None
        self._name = ""

    def start(self, prefix: str | None) -> None:
        """Raises RuntimeError when a profile is already running on this rank."""
        if self._session is not None:
            raise RuntimeError(
                f"a profile is already running on rank {self.rank} (as {self._name!r}); call "
                "stop_profile() before starting another"
            )
        config = self.config
        os.makedirs(config.torch_profiler_dir, exist_ok=True)
        session = profile(
            activities=self.activities,
            record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory,
            with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
        )
        session.start()
        self._session = session
        self._name = f"{prefix}_rank{self.rank}" if prefix else f"rank{self.rank}"

    def stop(self) -> str:
        """Stops recording and writes this rank's trace and table; returns the trace's path.

        Raises:
            RuntimeError: no profile is running on this rank.
        """
        session = self._session
        if session is None:
            raise RuntimeError(
                f"no profile is running on rank {self.rank}; call start_profile() first"
            )
        self._session = None
        session.stop()
        base = os.path.join(
            self.config.torch_profiler_dir, f"{self._name}.{int(time.time() * 1000)}"
        )
        trace = base + ".pt.trace.json" + (".gz" if self.config.torch_profiler_use_gzip else "")
        session.export_chrome_trace(trace)
        sort_by = "self_cuda_time_total" if len(self.activities) > 1 else "self_cpu_time_total"
        with open(base + ".txt", "w") as f:
            f.write(session.key_averages().table(sort_by=sort_by, row_limit=_TABLE_ROWS))
        logger.info("Profile of rank %d: %s, and its op table %s.txt", self.rank, trace, base)
        return trace
