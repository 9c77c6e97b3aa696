"""LoRA through `LLM` (and `AsyncLLM.generate`) on real processes and weights: each prompt's
greedy tokens are those of transformers running the base model with that prompt's adapter merged
into its weights (W + alpha / r * B A), with adapters and the base model mixed in one batch; with
fewer slots than adapters (the scheduler takes turns, the workers swap slots and reload evicted
adapters), at tensor_parallel_size 2 (every projection's A and B sharded as its weight is) with
preemption and chunked prefills, and on Qwen3 (a head size of its own, q/k norms). A bad adapter
fails its own request and nothing else."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from tests.entrypoints.llm_utils import (
    GREEDY,
    PROMPTS,
    hf_beam_search,
    hf_greedy,
    make_llm,
    token_ids,
)
from tests.entrypoints.openai.server_utils import make_tiny_checkpoint
from tests.lora.adapters import make_adapter, merged_hf_model
from tests.model.checkpoints import make_checkpoint
from tests.timeouts import scaled
from v1engine import AsyncLLM, BeamSearchParams, EngineArgs
from v1engine.config import LoRAConfig
from v1engine.core_protocol import EngineCoreInfo
from v1engine.lora.request import LoRARequest
from v1engine.request import EngineCoreRequest, validate_request
from v1engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return _setup(tmp_path_factory.mktemp("lora"), "llama")


def _setup(tmp, arch: str):
    """The base checkpoint of preset `arch`, two adapters (one on every projection, one of rank
    2 on q, v and down only), each prompt's adapter and the reference tokens."""
    base = make_checkpoint(tmp, arch)
    config = AutoConfig.from_pretrained(base)
    full = make_adapter(tmp / "full", config, seed=1)
    partial = make_adapter(
        tmp / "partial", config, seed=2, rank=2, targets=("q_proj", "v_proj", "down_proj")
    )
    loras = {"full": LoRARequest("full", 1, full), "partial": LoRARequest("partial", 2, partial)}
    per_prompt = [loras["full"], None, loras["partial"], loras["full"], loras["partial"]]
    models = {
        None: AutoModelForCausalLM.from_pretrained(base).eval(),
        "full": merged_hf_model(base, full),
        "partial": merged_hf_model(base, partial),
    }
    max_tokens = GREEDY.max_tokens
    expected = [
        hf_greedy(models[None if lora is None else lora.lora_name], [prompt], max_tokens)[0]
        for prompt, lora in zip(PROMPTS, per_prompt)
    ]
    base_tokens = hf_greedy(models[None], PROMPTS, max_tokens)
    # Each adapter changes its prompts' tokens: the comparison would notice an ignored one.
    for lora, got, plain in zip(per_prompt, expected, base_tokens):
        assert (got != plain) == (lora is not None)
    return base, per_prompt, expected, tmp, models


@pytest.fixture(scope="module")
def one_slot_llm(setup):
    """One slot for two adapters: they take turns, each reloaded after the other evicted it."""
    with make_llm(setup[0], enable_lora=True, max_loras=1) as llm:
        yield llm


def test_adapters_and_the_base_model_in_one_batch_match_merged_weights(setup, one_slot_llm):
    _, per_prompt, expected, _, models = setup
    llm = one_slot_llm
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=per_prompt)
    assert token_ids(outputs) == expected
    # One adapter for every prompt, then none: the base model's tokens are untouched.
    single = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=per_prompt[0])
    assert token_ids(single) == expected[:1]
    chat_free = llm.generate(PROMPTS[1:2], GREEDY, use_tqdm=False)
    assert token_ids(chat_free) == expected[1:2]
    search = BeamSearchParams(beam_width=2, max_tokens=4)
    (found,) = llm.beam_search(PROMPTS[:1], search, lora_request=per_prompt[0])
    prompt = PROMPTS[0]
    got = [(s.tokens[len(prompt) :], s.cum_logprob) for s in found.sequences]
    want = hf_beam_search(models["full"], prompt, width=2, max_tokens=4)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    assert [p for _, p in got] == pytest.approx([p for _, p in want], abs=1e-4)


def test_tensor_parallel_ranks_shard_each_adapter_under_preemption_and_chunking(setup):
    base, per_prompt, expected, *_ = setup
    # As test_llm's preemption test: 14 usable blocks of 4 tokens cannot hold the five
    # requests, and a 16-token budget chunks the 37-token prompt.
    cramped = dict(
        block_size=4, num_gpu_blocks_override=15, max_model_len=56, max_num_batched_tokens=16
    )
    with make_llm(base, enable_lora=True, max_loras=2, tensor_parallel_size=2, **cramped) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=per_prompt)
        assert token_ids(outputs) == expected
        assert llm.engine_core.scheduler.make_stats().num_preemptions > 0


def test_qwen3_with_its_own_head_size_and_qk_norms(tmp_path):
    base, per_prompt, expected, *_ = _setup(tmp_path, "qwen3")  # head_dim 32, hidden 64
    with make_llm(base, enable_lora=True, max_loras=2) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=per_prompt)
        assert token_ids(outputs) == expected


def test_a_bad_adapter_fails_its_request_only(setup, one_slot_llm):
    base, per_prompt, expected, tmp, _ = setup
    llm = one_slot_llm
    too_wide = make_adapter(tmp / "rank32", AutoConfig.from_pretrained(base), rank=32)
    with pytest.raises(ValueError, match="max_lora_rank is 16"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("wide", 3, too_wide))
    with pytest.raises(ValueError, match="no adapter_config.json there"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("gone", 4, str(tmp / "x")))
    with pytest.raises(ValueError, match="got 2 lora requests for 5 prompts"):
        llm.generate(PROMPTS, GREEDY, lora_request=per_prompt[:2])
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=per_prompt)
    assert token_ids(outputs) == expected
    other = LoRARequest("other", 1, per_prompt[2].lora_path)  # id 1 is "full"'s
    with pytest.raises(ValueError, match="lora_int_id 1 already names the adapter"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=other)


def test_an_engine_without_lora_refuses_adapters_naming_the_flag():
    request = EngineCoreRequest(
        "r", [1, 2], SamplingParams(), lora_request=LoRARequest("a", 1, "/a")
    )
    with pytest.raises(
        ValueError, match=r"serves no adapters; start it with enable_lora=True \(--enable-lora\)"
    ):
        validate_request(request, EngineCoreInfo(8, 16, 64, 100), set())
    validate_request(request, EngineCoreInfo(8, 16, 64, 100, max_loras=1), set())
    with pytest.raises(ValueError, match="max_cpu_loras must be >= max_loras"):
        LoRAConfig(max_loras=2, max_cpu_loras=1)


def test_async_llm_generate_runs_a_lora_request(tmp_path):
    base = make_tiny_checkpoint(str(tmp_path / "model"))  # with a tokenizer, as AsyncLLM needs
    adapter = make_adapter(tmp_path / "adapter", AutoConfig.from_pretrained(base))
    expected = hf_greedy(merged_hf_model(base, adapter), PROMPTS[:1], GREEDY.max_tokens)[0]
    lora = LoRARequest("a", 1, adapter)
    args = EngineArgs(
        base, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 22
    )

    async def generate() -> list[int]:
        lora_args = dataclasses.replace(args, enable_lora=True)
        async with AsyncLLM.from_engine_args(lora_args) as engine:
            prompt = {"prompt_token_ids": PROMPTS[0]}
            outputs = engine.generate(prompt, GREEDY, "r", lora_request=lora, output_kind="final")
            return [output async for output in outputs][-1].outputs[0].token_ids

    assert asyncio.run(asyncio.wait_for(generate(), scaled(180))) == expected
