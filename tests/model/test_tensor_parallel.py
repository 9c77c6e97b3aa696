"""Tensor parallelism over gloo: two spawned CPU ranks must reproduce transformers' logits.

One spawn of two processes runs every checkpoint (process start-up dominates the cost). Cases
cover GQA split over ranks, a single KV head replicated on both ranks, tied embeddings, a
vocabulary (131) that must be padded to split, q/k/v bias, q/k norm and sliding windows.
"""

from __future__ import annotations

import multiprocessing
import os

import torch

from tests.model.checkpoints import load_hf_model, make_checkpoint
from tests.model.paged_runner import generate_paged
from tests.model.test_model_parity import MAX_NEW_TOKENS, check_against_hf, make_prompts
from v1engine.model.hf_config import load_hf_config
from v1engine.model.loader import load_model
from v1engine.model.parallel_state import (
    destroy_distributed,
    get_tp_rank,
    get_tp_world_size,
    init_distributed,
)
from v1engine.process import get_distributed_init_method

WORLD_SIZE = 2
TIMEOUT_S = 240
TP_CASES = {
    "llama": {},
    "llama_tied": {"num_key_value_heads": 1},  # 1 KV head on 2 ranks: replicated
    "llama3_rope": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "gemma2": {},
    "gemma3": {},
    "smollm3": {},
    "granite": {},
    "qwen3_moe": {},
    "qwen2_moe": {},
    "mixtral": {},
    "phi3": {},
    "olmo2": {"num_key_value_heads": 1},  # the k norm's one head on both ranks
    "olmo3": {},
    "gpt2": {},
    "gpt_neox": {},
    "phi": {},
    "starcoder2": {},
}


def _tp_worker(rank: int, init_method: str, paths: list[str], prompts, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks share the machine's cores
    init_distributed(rank, WORLD_SIZE, init_method, backend="gloo")
    try:
        assert (get_tp_rank(), get_tp_world_size()) == (rank, WORLD_SIZE)
        results = {}
        for path in paths:
            model = load_model(path, load_hf_config(path), torch.float32, "cpu")
            num_params = sum(p.numel() for p in model.parameters())
            outputs, logits = generate_paged(model, prompts, MAX_NEW_TOKENS)
            results[path] = (outputs, logits, num_params)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_distributed()


def _run_ranks(paths: list[str], prompts, out_dir: str) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    init_method = get_distributed_init_method()
    procs = [
        ctx.Process(target=_tp_worker, args=(rank, init_method, paths, prompts, out_dir))
        for rank in range(WORLD_SIZE)
    ]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert [p.exitcode for p in procs] == [0] * WORLD_SIZE, "a rank failed; see its stderr"
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD_SIZE)]


def test_tensor_parallel_2_matches_transformers(tmp_path):
    paths = [make_checkpoint(tmp_path, arch, **overrides) for arch, overrides in TP_CASES.items()]
    prompts = make_prompts(131)
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    per_rank = _run_ranks(paths, prompts, str(out_dir))
    for path in paths:
        hf_model = load_hf_model(path)
        num_full_params = sum(p.numel() for p in hf_model.parameters())
        for results in per_rank:
            outputs, logits, num_params = results[path]
            check_against_hf(hf_model, prompts, outputs, logits)
            # No rank holds the whole model (only norms, and replicated KV heads, are repeated).
            assert num_params < 0.75 * num_full_params, (path, num_params, num_full_params)
