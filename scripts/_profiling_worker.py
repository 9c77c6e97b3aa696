"""The worker `profile_steps.py` runs: the built-in `Worker`, timing each phase of a step.

It is spawned by v1engine's executor from `worker_cls="_profiling_worker.ProfilingWorker"`
(scripts/ is on sys.path of the benchmark and its spawned children). Phases of
`GPUModelRunner.execute_model` are timed by wrapping the runner's own methods, and the forward is
split by layer kind with forward hooks on the model's leaf modules: each leaf's time is inclusive
of what it calls, leaves do not nest, and "layer glue" is the rest of the forward (the decoder
layers' Python between leaves); the decoder stack of small decode steps (all layers in one C
call) is one row. Hooks cost a few microseconds per leaf call, which the table's
forward total includes; the plain `execute_model` time is measured by the engine side without them.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from v1engine.worker import gpu_model_runner, step_sampler
from v1engine.worker.gpu_worker import Worker

# Leaf module class name -> the row it is counted in.
_LAYER_KINDS = {
    "QKVParallelLinear": "matmul: qkv_proj",
    "RowParallelLinear": "matmul: o_proj/down_proj",
    "MergedColumnParallelLinear": "matmul: gate_up_proj",
    "Attention": "attention (write K/V + attend)",
    "RMSNorm": "norms (+ residual add)",
    "RotaryEmbedding": "rotary",
    "SiluAndMul": "activation",
    "VocabParallelEmbedding": "embedding",
}
# Decode steps of a few tokens run every layer in one C call (models/llama_decode_stack.py),
# which no leaf hook sees: it is timed as one row.
_DECODE_STACK_LABEL = "decoder stack (all layers, one C call)"
LEAF_LABELS = frozenset(_LAYER_KINDS.values()) | {_DECODE_STACK_LABEL}


class _TimedDecodeStack:
    """Stands in for a model's `decode_stack`, timing its calls."""

    def __init__(self, stack: Any, timed: Callable[..., Any]) -> None:
        self.applies = stack.applies
        self._timed = timed

    def __call__(self, *args: Any) -> Any:
        return self._timed(*args)


class ProfilingWorker(Worker):
    """Keeps, per step kind ("decode" when every request computes one token, else "mixed"),
    the summed seconds of each phase; `step_profile()` returns and clears them."""

    def init_device(self) -> None:
        super().init_device()
        threads = os.environ.get("PROFILE_STEPS_THREADS")
        if threads:  # profile_steps.py --threads: override the worker's own choice
            torch.set_num_threads(int(threads))

    def load_model(self) -> None:
        super().load_model()
        self._totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._steps: dict[str, int] = defaultdict(int)
        self._current: dict[str, float] = defaultdict(float)
        runner = self.model_runner
        for name in ("_update_states", "_forward"):
            setattr(runner, name, self._timed(name.strip("_"), getattr(runner, name)))
        sampler = runner.step_sampler
        sampler.sample = self._timed("sample", sampler.sample)
        self._wrap_module_function(gpu_model_runner, "build_model_inputs", "build model inputs")
        self._wrap_module_function(gpu_model_runner, "compute_prompt_logprobs", "prompt_logprobs")
        self._wrap_module_function(step_sampler, "build_sampling_metadata", "sampling metadata")
        sampler.sampler = self._timed("sampler", sampler.sampler)
        self._hook_leaves(runner.model)
        inner = getattr(runner.model, "model", None)
        stack = getattr(inner, "decode_stack", None)  # None: a model without one (Gemma, MoE)
        if stack is not None:
            timed = self._timed(_DECODE_STACK_LABEL, stack.__call__)
            inner.decode_stack = _TimedDecodeStack(stack, timed)
        original_logits = runner.model.compute_logits
        runner.model.compute_logits = self._timed("lm head (logits)", original_logits)

    def _wrap_module_function(self, module: Any, name: str, label: str) -> None:
        setattr(module, name, self._timed(label, getattr(module, name)))

    def _timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._current[label] += time.perf_counter() - start

        return timed

    def _hook_leaves(self, model: torch.nn.Module) -> None:
        starts: dict[int, float] = {}

        def pre(module: torch.nn.Module, _inputs: Any) -> None:
            starts[id(module)] = time.perf_counter()

        def post(module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
            label = _LAYER_KINDS[type(module).__name__]
            self._current[label] += time.perf_counter() - starts.pop(id(module))

        for module in model.modules():
            if type(module).__name__ in _LAYER_KINDS:
                module.register_forward_pre_hook(pre)
                module.register_forward_hook(post)

    def execute_model(self, scheduler_output: Any) -> Any:
        self._current = defaultdict(float)
        start = time.perf_counter()
        output = super().execute_model(scheduler_output)
        self._current["worker execute_model"] = time.perf_counter() - start
        counts = scheduler_output.num_scheduled_tokens
        kind = "decode" if counts and all(n == 1 for n in counts.values()) else "mixed"
        if scheduler_output.total_num_scheduled_tokens:
            self._steps[kind] += 1
            for label, seconds in self._current.items():
                self._totals[kind][label] += seconds
        return output

    def step_profile(self) -> dict[str, Any]:
        result = {
            kind: {"steps": self._steps[kind], "seconds": dict(self._totals[kind])}
            for kind in self._steps
        }
        self._totals.clear()
        self._steps.clear()
        return result
