"""One system's side of `bench_peers.py`, run in that system's own interpreter.

    PYTHON _peer_runner.py {v1engine,v1engine-sync,vllm,llama.cpp} --model PATH \\
        --requests R.json --out O.json

Standalone on purpose (standard library plus the system itself): the vLLM and llama.cpp venvs have
no v1engine. It loads the model, warms up with one short request, then runs the workloads of
R.json once each and writes what it measured: load seconds, and per workload the output tokens,
the seconds they took and (the one-request workloads, decode1 and long1) the token ids, so the
driver can check that every system produced the same greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

Request = tuple[list[int], int]  # (prompt token ids, output tokens)


class V1Engine:
    async_scheduling = True

    def __init__(self, model: str, threads: int, max_model_len: int, dtype: str) -> None:
        from v1engine import LLM, SamplingParams

        self._params = SamplingParams
        self.llm = LLM(
            model,
            dtype=dtype,
            max_model_len=max_model_len,
            async_scheduling=self.async_scheduling,
        )

    def generate(self, requests: list[Request]) -> list[list[int]]:
        prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
        params = [self._params(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def close(self) -> None:
        self.llm.shutdown()


class VLLM:
    memory_utilization: float | None = None

    def __init__(self, model: str, threads: int, max_model_len: int, dtype: str) -> None:
        from vllm import LLM, SamplingParams

        self._params = SamplingParams
        # On CPU, vLLM's gpu_memory_utilization is the share of the NUMA node's memory it
        # reserves; where the node reports less memory than the machine has, 0.92 fails.
        memory = (
            {"gpu_memory_utilization": VLLM.memory_utilization} if VLLM.memory_utilization else {}
        )
        self.llm = LLM(model, dtype=dtype, max_model_len=max_model_len, seed=0, **memory)

    def generate(self, requests: list[Request]) -> list[list[int]]:
        prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
        params = [self._params(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def close(self) -> None:
        pass


class LlamaCpp:
    """llama-cpp-python's `Llama`, one request at a time (its Python API has no batching); the
    dtype is the GGUF file's."""

    def __init__(self, model: str, threads: int, max_model_len: int, dtype: str) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=model,
            n_ctx=max_model_len,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            seed=0,
            verbose=False,
        )

    def generate(self, requests: list[Request]) -> list[list[int]]:
        results = []
        for ids, num_tokens in requests:
            tokens: list[int] = []
            # temp 0: greedy; generate() never stops at EOS on its own (EOS ignored, as above).
            for token in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
                tokens.append(token)
                if len(tokens) == num_tokens:
                    break
            results.append(tokens)
        return results

    def close(self) -> None:
        self.llm.close()


class V1EngineSync(V1Engine):
    """v1engine with async scheduling off: each step's outputs are read before the next."""

    async_scheduling = False


SYSTEMS = {
    "v1engine": V1Engine,
    "v1engine-sync": V1EngineSync,
    "vllm": VLLM,
    "llama.cpp": LlamaCpp,
}


def timed(system: Any, requests: list[Request]) -> dict[str, Any]:
    start = time.perf_counter()
    outputs = system.generate(requests)
    seconds = time.perf_counter() - start
    return {"tokens": sum(len(o) for o in outputs), "seconds": seconds, "outputs": outputs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("system", choices=sorted(SYSTEMS))
    p.add_argument("--model", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--vllm-memory-utilization", type=float, default=None)
    args = p.parse_args()
    VLLM.memory_utilization = args.vllm_memory_utilization
    with open(args.requests) as f:
        workloads = json.load(f)
    start = time.perf_counter()
    system = SYSTEMS[args.system](args.model, args.threads, args.max_model_len, args.dtype)
    result: dict[str, Any] = {"load_s": time.perf_counter() - start}
    try:
        system.generate([(list(range(100, 116)), 8)])  # warm-up, sharing no prefix
        for name, requests in workloads.items():
            run = timed(system, [(ids, n) for ids, n in requests])
            if len(requests) > 1:  # a one-request workload's tokens are compared
                run.pop("outputs")
            result[name] = run
    finally:
        system.close()
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
