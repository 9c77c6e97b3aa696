"""Weights after start-up, as RL trainers feed vLLM: `load_format="dummy"` starts without reading
the checkpoint, a `worker_extension_cls` method loads a trainer's tensors on every rank through
`collective_rpc` (`model.load_weights`, any part of the checkpoint), `reload_weights` reads the
checkpoint again; the tokens then equal those of an engine that loaded it at start-up, so the
copies derived from the weights (packed gemm weights, the greedy screen) followed them."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file

from tests.entrypoints.llm_utils import GREEDY, PROMPTS, make_llm, token_ids
from v1engine.executor.errors import WorkerError

EXTENSION = "tests.entrypoints.weight_sync.WeightSync"


@pytest.fixture(scope="module")
def loaded_tokens(llama_checkpoint) -> list[list[int]]:
    with make_llm(llama_checkpoint) as llm:
        return token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_trainers_weights_replace_dummy_ones(llama_checkpoint, loaded_tokens, tp):
    checkpoint = load_file(os.path.join(llama_checkpoint, "model.safetensors"))
    names = sorted(checkpoint)
    first, rest = names[: len(names) // 2], names[len(names) // 2 :]
    llm = make_llm(
        llama_checkpoint, load_format="dummy", worker_extension_cls=EXTENSION,
        tensor_parallel_size=tp,
    )  # fmt: skip
    with llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) != loaded_tokens
        for part in (first, rest):  # two updates, each of part of the model
            weights = [(name, checkpoint[name]) for name in part]
            loaded = llm.collective_rpc("load_trainer_weights", args=(weights,))
            assert len(loaded) == tp and all(set(r) <= set(part) for r in loaded)
        assert llm.reset_prefix_cache()  # the cached prefixes hold the dummy weights' K/V
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == loaded_tokens


def test_reload_weights_reads_the_checkpoint_again(llama_checkpoint, loaded_tokens):
    with make_llm(llama_checkpoint, load_format="dummy") as llm:
        dummy = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        llm.collective_rpc("reload_weights")
        llm.reset_prefix_cache()
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == loaded_tokens
    assert dummy != loaded_tokens


def test_a_bad_tensor_fails_on_every_rank_and_the_engine_goes_on(llama_checkpoint, loaded_tokens):
    checkpoint = load_file(os.path.join(llama_checkpoint, "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    with make_llm(llama_checkpoint, worker_extension_cls=EXTENSION, tensor_parallel_size=2) as llm:
        for bad, match in [
            (("model.no_such.weight", checkpoint[name]), "has no parameter"),
            ((name, checkpoint[name].T.contiguous()), "has shape"),
        ]:
            with pytest.raises(WorkerError, match=match) as info:
                llm.collective_rpc("load_trainer_weights", args=([bad],))
            assert "rank 0" in str(info.value) and "rank 1" in str(info.value)
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == loaded_tokens


def test_an_extension_may_not_replace_a_worker_method(llama_checkpoint):
    with pytest.raises(ValueError, match=r"defines \['load_model'\].*rename them"):
        make_llm(
            llama_checkpoint, worker_extension_cls="tests.entrypoints.weight_sync.ClashingExtension"
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"worker_extension_cls": "no_such_module.Sync"},
            "worker_extension_cls 'no_such_module.Sync': cannot import",
        ),
        ({"worker_extension_cls": "Sync"}, "dotted 'module.Class' path"),
        ({"load_format": "gguf"}, "load_format='gguf' but model .* is not a .gguf file"),
        (
            {"load_format": "pt"},
            r"load_format must be one of \('auto', 'safetensors', 'gguf', 'dummy'\)",
        ),
    ],
)
def test_bad_options_are_refused_before_any_worker_starts(llama_checkpoint, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_llm(llama_checkpoint, **kwargs)
