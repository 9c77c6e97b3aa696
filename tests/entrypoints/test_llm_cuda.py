"""`LLM` end to end on a GPU, against transformers on the same GPU: the CUDA worker with and
without CUDA graphs, preemption and chunked prefill, prompt and sample logprobs, seeded sampling,
structured outputs (xgrammar's bitmask applied to logits in device memory) and bfloat16.
Skipped without CUDA (tests/conftest.py); the CPU twins of these tests are in the other
test_llm_*.py files."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tests.entrypoints.llm_utils import (
    GREEDY,
    PREEMPTING,
    PROMPTS,
    SEEDED,
    all_blocks_free,
    hf_greedy,
    make_llm,
    preempted_greedy,
    seeded_alone_and_in_batch,
    token_ids,
)
from tests.entrypoints.openai.server_utils import make_tiny_checkpoint
from tests.model.checkpoints import load_hf_model
from v1engine.sampling_params import SamplingParams
from v1engine.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.gpu

# Float32 on a GPU: other kernels, another summation order (transformers' own, ours, Triton's).
ATOL = 2e-3
CUDA = dict(device="cuda", kv_cache_memory_bytes=64 << 20)
# More prompts than the smallest CUDA-graph sizes, so a padded graph batch is replayed too.
MANY = PROMPTS + [[(7 * i + j) % 120 + 3 for j in range(3 + i)] for i in range(11)]


def graph_replays(worker) -> int | None:
    graphs = worker.model_runner.cuda_graphs
    return None if graphs is None else graphs.num_replays


@pytest.fixture(scope="module")
def hf_cuda(llama_checkpoint):
    return load_hf_model(llama_checkpoint).to("cuda")


@pytest.fixture(scope="module")
def llm_cuda(llama_checkpoint):
    with make_llm(llama_checkpoint, **CUDA) as llm:
        yield llm


def test_greedy_tokens_equal_transformers_with_and_without_cuda_graphs(
    llm_cuda, llama_checkpoint, hf_cuda
):
    expected = hf_greedy(hf_cuda, MANY, GREEDY.max_tokens)
    assert token_ids(llm_cuda.generate(MANY, GREEDY, use_tqdm=False)) == expected
    assert all_blocks_free(llm_cuda)
    [replays] = llm_cuda.collective_rpc(graph_replays)
    assert replays  # decode steps ran as graph replays
    with make_llm(llama_checkpoint, enforce_eager=True, **CUDA) as eager:
        assert token_ids(eager.generate(MANY, GREEDY, use_tqdm=False)) == expected
        assert eager.collective_rpc(graph_replays) == [None]


def test_preemption_and_chunked_prefill_keep_tokens_exact(llama_checkpoint, hf_cuda):
    with make_llm(llama_checkpoint, **PREEMPTING, **CUDA) as llm:
        got = preempted_greedy(llm)
    assert got == hf_greedy(hf_cuda, PROMPTS, GREEDY.max_tokens)


def test_prompt_and_sample_logprobs_equal_transformers(llm_cuda, hf_cuda):
    params = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    for output in llm_cuda.generate(PROMPTS, params, use_tqdm=False):
        completion = output.outputs[0]
        tokens = output.prompt_token_ids + completion.token_ids
        with torch.no_grad():
            logits = hf_cuda(torch.tensor([tokens], device="cuda")).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1).cpu()
        prompt_len = len(output.prompt_token_ids)
        entries = output.prompt_logprobs[1:] + completion.logprobs
        assert len(entries) == len(tokens) - 1
        for position, entry in enumerate(entries):
            token = tokens[position + 1]
            expected = reference[position, token].item()
            assert entry[token].logprob == pytest.approx(expected, abs=ATOL)
            top = reference[position].topk(3).indices.tolist()
            if position >= prompt_len - 1:
                assert token == top[0]  # greedy
            assert set(top) <= set(entry)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm_cuda):
    alone, in_batch = seeded_alone_and_in_batch(llm_cuda)
    assert alone == in_batch and len(alone) == SEEDED.max_tokens


def test_bfloat16_greedy_follows_float32(llama_checkpoint, llm_cuda):
    fp32 = token_ids(llm_cuda.generate(PROMPTS, GREEDY, use_tqdm=False))
    with make_llm(llama_checkpoint, **{**CUDA, "dtype": "bfloat16"}) as llm:
        bf16 = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert [len(t) for t in bf16] == [GREEDY.max_tokens] * len(PROMPTS)
    # The test weights keep logits far from ties, so rounding to bf16 rarely flips the first pick.
    assert sum(a[0] == b[0] for a, b in zip(fp32, bf16)) >= len(PROMPTS) - 1


def byte_level_tokenizer():
    """A small byte-level BPE tokenizer trained here (any text encodes; xgrammar reads it as
    BYTE_LEVEL), so this test needs no tokenizer files from the default model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ['{"color": "red", "count": 3, "ok": true}', "tell me about cats and rain"]
    tokenizer.train_from_iterator(corpus * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["color", "ok", "count"],
    "additionalProperties": False,
}


def test_structured_outputs_follow_their_schema_and_choice(tmp_path):
    checkpoint = make_tiny_checkpoint(str(tmp_path), tokenizer=byte_level_tokenizer())
    json_params = SamplingParams(
        max_tokens=80,
        temperature=1.0,
        seed=3,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    )
    choice = SamplingParams(
        max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["cats", "rain"])
    )
    prompts = [f"tell me about cats {i}" for i in range(12)]
    with make_llm(checkpoint, skip_tokenizer_init=False, max_model_len=256, **CUDA) as llm:
        outputs = llm.generate(prompts, [json_params, choice] * 6, use_tqdm=False)
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        if i % 2:
            assert completion.text in ("cats", "rain")
        else:
            jsonschema.validate(json.loads(completion.text), SCHEMA)
