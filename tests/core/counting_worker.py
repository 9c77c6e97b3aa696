"""A model-free worker for engine-process tests: it "generates" (last token + 1) % VOCAB_SIZE.

It applies each SchedulerOutput with the real `RequestStates`, as the model runner does, and
samples only for batch rows whose computed tokens reach the end of their known tokens, so the
tokens it returns prove the whole path (client -> core -> scheduler -> worker) kept them.
"""

from __future__ import annotations

import os
import time

import torch

from v1engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from v1engine.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from v1engine.outputs import ModelRunnerOutput, SchedulerOutput
from v1engine.worker.request_states import InputBatch, RequestStates
from v1engine.worker.worker_base import WorkerBase

VOCAB_SIZE = 50
MAX_MODEL_LEN = 64


def make_config(worker_cls: str = "CountingWorker", tensor_parallel_size: int = 2) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(max_model_len=MAX_MODEL_LEN),
        cache_config=CacheConfig(block_size=16),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            worker_cls=f"tests.core.counting_worker.{worker_cls}",
        ),
        scheduler_config=SchedulerConfig(
            max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64, max_num_seqs=8
        ),
    )


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return [(prompt[-1] + i) % VOCAB_SIZE for i in range(1, max_tokens + 1)]


class CountingWorker(WorkerBase):
    def load_model(self) -> None:
        self.states: RequestStates | None = None
        self.step_delay_s = 0.0
        self.gate: tuple[str, float] | None = None

    def get_kv_cache_spec(self) -> dict[str, FullAttentionSpec]:
        return {"layers.0": FullAttentionSpec(16, 1, 8, torch.float32)}

    def determine_available_memory(self) -> int:
        return 4 << 20

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.num_blocks = kv_cache_config.num_blocks
        scheduler_config = self.config.scheduler_config
        block_sizes = [group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups]
        batch = InputBatch(
            scheduler_config.max_num_seqs, scheduler_config.max_model_len, block_sizes
        )
        self.states = RequestStates(batch, generator_device="cpu")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        time.sleep(self.step_delay_s)
        if self.gate is not None:
            self._wait_for_gate(*self.gate)
        self.states.update(scheduler_output)
        batch = self.states.input_batch
        req_ids, sampled = list(batch.req_ids), []
        for row, req_id in enumerate(req_ids):
            num_tokens = int(batch.num_tokens[row])
            end = (
                int(batch.num_computed_tokens[row]) + scheduler_output.num_scheduled_tokens[req_id]
            )
            last_token = int(batch.token_ids[row, num_tokens - 1])
            sampled.append([(last_token + 1) % VOCAB_SIZE] if end >= num_tokens else [])
        # Every rank computes the same tokens here, so each appends its own (the runner's ranks
        # append the driver's).
        self.states.append_sampled(req_ids, sampled)
        return ModelRunnerOutput(req_ids, sampled) if self.rank == 0 else None

    # -- for collective_rpc tests ----------------------------------------------------------------
    def set_step_delay(self, seconds: float) -> None:
        self.step_delay_s = seconds

    def set_gate(self, path: str, timeout_s: float) -> None:
        """Makes every step wait until `path` exists (at most `timeout_s`)."""
        self.gate = (path, timeout_s)

    @staticmethod
    def _wait_for_gate(path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {path} did not open within {timeout_s} s")
            time.sleep(0.005)

    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def get_pid(self) -> int:
        return os.getpid()

    def echo(self, value, suffix: str = "") -> list:
        return [value, suffix, self.rank]

    def fail(self, message: str) -> None:
        raise RuntimeError(f"{message} on rank {self.rank}")

    def make_tensor(self) -> torch.Tensor:
        return torch.zeros(2)

    def num_known_requests(self) -> int:
        return len(self.states.requests)


class FailingLoadWorker(CountingWorker):
    def load_model(self) -> None:
        if self.rank == 1:
            # The engine core's pid, so the test can check that it left nothing behind.
            raise RuntimeError(f"no weights for rank 1 (engine core pid {os.getppid()})")
        super().load_model()


def rank_times(worker: CountingWorker, factor: int) -> int:
    """A module-level function run as fn(worker, *args)."""
    return worker.rank * factor
