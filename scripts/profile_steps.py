"""Where one engine step's time goes, split by phase, for decode steps and mixed steps.

    .venv/bin/python scripts/profile_steps.py --batch-sizes 1,64 --repeats 3 --json steps.json

For each batch size, `LLM.generate` runs that many requests (random prompt token ids of
`--prompt-len`, `--output-len` greedy tokens, EOS ignored) with the worker class
`_profiling_worker.ProfilingWorker`, after one warm-up round. Per step kind, in milliseconds per
step (medians over the repeats):

- engine core (this process, `LLM` runs the core in-process): `schedule`, `execute_model` as the
  core sees it (the broadcast of the SchedulerOutput, the worker's step, the reply),
  `update_from_output`, and the client's output processing (detokenization included);
- transport = the core's `execute_model` minus the worker's own `execute_model`: serialization,
  the ring buffer both ways and the waits in between;
- worker: applying the diff, building model inputs, the forward split by layer kind (matmuls,
  attention, norms, rotary, activation, embedding, and the decoder layers' Python glue), the LM
  head and the sampler.

The engine runs with async scheduling off, so that each step's phases follow one another and
add up (with it on, the next step's scheduling overlaps this step's forward; the worker's split
is the same either way).

`--busy` repeats each batch size with one busy process per core competing and prints the
busy/quiet ratio of the step time.

Hooks on the model's leaf modules cost a few microseconds each, so the worker's forward here is
a little slower than without them; the step totals are what to compare between commits.

`--device cuda` profiles the GPU path. Kernels run asynchronously there, so each row is the host
time spent launching that phase; the GPU catches up where the sampler copies its tokens to the
host ("sample"), and a step whose rows add up to its total is bound by the host, not the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from _bench_utils import busy_cores, cpu_machine_info, cuda_machine_info
from _profiling_worker import LEAF_LABELS

from v1engine import LLM, SamplingParams

_ENGINE_PHASES = ("schedule", "core execute_model", "update_from_output", "output processing")


class EngineTimer:
    """Wraps the in-process core's and the client's step methods; sums seconds per step kind."""

    def __init__(self, llm: LLM) -> None:
        core = llm.engine_core
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, int] = defaultdict(int)
        self.kind = "idle"
        self._wrap(core.scheduler, "schedule", "schedule", self._note_kind)
        self._wrap(core.executor, "execute_model", "core execute_model")
        self._wrap(core.scheduler, "update_from_output", "update_from_output")
        self._wrap(llm.llm_engine.output_processor, "process_outputs", "output processing")
        self._wrap(core, "step", "step total")

    def _note_kind(self, scheduler_output: Any) -> None:
        counts = scheduler_output.num_scheduled_tokens
        if not scheduler_output.total_num_scheduled_tokens:
            self.kind = "idle"
        else:
            self.kind = "decode" if all(n == 1 for n in counts.values()) else "mixed"
            self.steps[self.kind] += 1

    def _wrap(
        self, owner: Any, name: str, label: str, after: Callable[[Any], None] | None = None
    ) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, kind = time.perf_counter(), self.kind
            result = original(*args, **kwargs)
            if after is not None:
                after(result)
            if label == "step total":  # the kind of the step it scheduled, known only now
                kind = self.kind
            if isinstance(result, Future):  # the core launches steps non-blocking: until the reply
                result.add_done_callback(lambda _: self._add(kind, label, start))
            else:
                self._add(kind, label, start)
            return result

        setattr(owner, name, timed)

    def _add(self, kind: str, label: str, start: float) -> None:
        self.seconds[kind][label] += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds.clear()
        self.steps.clear()


def run_once(llm: LLM, timer: EngineTimer, args: argparse.Namespace, batch_size: int) -> dict:
    rng = random.Random(args.seed)
    vocab_size = llm.engine_core.info.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(args.prompt_len)]}
        for _ in range(batch_size)
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.engine_core.reset_prefix_cache()
    llm.engine_core.collective_rpc("step_profile", unique_reply_rank=0)  # clear
    timer.reset()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    worker = llm.engine_core.collective_rpc("step_profile", unique_reply_rank=0)
    table: dict[str, dict[str, float]] = {}
    for kind, steps in timer.steps.items():
        engine = {k: v / steps * 1e3 for k, v in timer.seconds[kind].items()}
        work = {k: v / steps * 1e3 for k, v in worker[kind]["seconds"].items()}
        row = {f"core: {k}": engine.get(k, 0.0) for k in _ENGINE_PHASES + ("step total",)}
        row["transport (core execute_model - worker)"] = (
            engine["core execute_model"] - work["worker execute_model"]
        )
        row.update({f"worker: {k}": v for k, v in sorted(work.items())})
        leaves = sum(v for k, v in work.items() if k in LEAF_LABELS)
        row["worker: layer glue (forward - leaves)"] = work.get("forward", 0.0) - leaves
        table[kind] = {"steps": steps, "ms_per_step": row}
    tokens = batch_size * args.output_len
    return {"wall_s": wall_s, "output_tok_s": tokens / wall_s, "kinds": table}


def median_table(runs: list[dict]) -> dict:
    result: dict[str, Any] = {
        "output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "kinds": {},
    }
    for kind in runs[0]["kinds"]:
        rows = [r["kinds"][kind]["ms_per_step"] for r in runs if kind in r["kinds"]]
        keys = rows[0].keys()
        result["kinds"][kind] = {
            "steps": runs[0]["kinds"][kind]["steps"],
            "ms_per_step": {k: statistics.median(row.get(k, 0.0) for row in rows) for k in keys},
        }
    return result


def print_table(batch_size: str, result: dict) -> None:
    print(
        f"\n== batch {batch_size}: {result['output_tok_s']:.1f} output tok/s "
        f"(wall {result['wall_s']:.2f} s, median) =="
    )
    for kind, entry in result["kinds"].items():
        print(f"-- {kind} steps ({entry['steps']} per run), ms per step --")
        for label, ms in entry["ms_per_step"].items():
            print(f"  {label:<45} {ms:8.2f}")


def print_busy_ratio(batch_size: int, results: dict) -> None:
    for kind in results["quiet"][str(batch_size)]["kinds"]:
        quiet, busy = (
            results[load][str(batch_size)]["kinds"][kind]["ms_per_step"]["core: step total"]
            for load in ("quiet", "busy")
        )
        print(f"batch {batch_size} {kind} step: busy/quiet {busy / quiet:.2f}x")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="override the worker's threads")
    p.add_argument("--busy", action="store_true", help="also with one busy process per core")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.threads is not None:
        os.environ["PROFILE_STEPS_THREADS"] = str(args.threads)  # the spawned worker reads it
    llm = LLM(
        args.model,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(batch_sizes),
        worker_cls="_profiling_worker.ProfilingWorker",
        # The phases are split per step, so steps run one after the other here.
        async_scheduling=False,
    )
    results: dict[str, Any] = {"quiet": {}, "busy": {}}
    try:
        timer = EngineTimer(llm)
        for batch_size in batch_sizes:
            run_once(llm, timer, args, batch_size)  # warm-up
            for load in ("quiet", "busy") if args.busy else ("quiet",):
                with busy_cores(load == "busy"):
                    runs = [run_once(llm, timer, args, batch_size) for _ in range(args.repeats)]
                results[load][str(batch_size)] = median_table(runs)
                print_table(f"{batch_size}, {load}", results[load][str(batch_size)])
            if args.busy:
                print_busy_ratio(batch_size, results)
    finally:
        llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            machine = cpu_machine_info() if args.device == "cpu" else cuda_machine_info()
            json.dump({"args": vars(args), "machine": machine, "results": results}, f)


if __name__ == "__main__":
    main()
