"""LoRA without an engine: reading and checking PEFT adapter folders, LoRARequest and
--lora-modules values, the scheduler's max_loras, and adapters in the prefix-cache hash."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.core.fake_worker import make_request, make_scheduler, make_worker, run_to_completion
from tests.core.fake_worker import step as run_step
from tests.core.test_kv_cache_manager import _manager, _prefill
from tests.lora.adapters import make_adapter
from tests.model.checkpoints import make_config
from v1engine.config import EngineConfig, LoRAConfig, ModelConfig
from v1engine.entrypoints.openai.serving_models import check_lora_modules, parse_lora_modules
from v1engine.lora.adapter import CheckedAdapters, load_adapter
from v1engine.lora.request import LoRARequest

CONFIG = make_config("llama")  # hidden 64, 4 heads of 16, 2 KV heads, intermediate 128


def test_an_adapter_loads_with_its_scaling_folded_into_b(tmp_path):
    path = make_adapter(tmp_path / "a", CONFIG, rank=4, alpha=8, targets=("q_proj", "down_proj"))
    adapter = load_adapter(path, CONFIG, max_lora_rank=16)
    assert adapter.rank == 4
    assert sorted(adapter.weights) == [
        (0, "down_proj"),
        (0, "q_proj"),
        (1, "down_proj"),
        (1, "q_proj"),
    ]
    raw = load_file(os.path.join(path, "adapter_model.safetensors"))
    a, b = adapter.weights[(1, "q_proj")]
    name = "base_model.model.model.layers.1.self_attn.q_proj"
    assert torch.equal(a, raw[f"{name}.lora_A.weight"])
    assert torch.allclose(b, raw[f"{name}.lora_B.weight"] * 2.0)  # alpha / r
    rslora = make_adapter(tmp_path / "r", CONFIG, rank=4, alpha=8, use_rslora=True)
    _, b = load_adapter(rslora, CONFIG, 16).weights[(0, "q_proj")]
    raw = load_file(os.path.join(rslora, "adapter_model.safetensors"))
    assert torch.allclose(
        b, raw["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] * 4.0
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"use_dora": True}, "use_dora=True"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "peft_type='IA3'"),
        ({"r": "four"}, "needs an int r"),
    ],
)
def test_an_adapter_this_engine_cannot_serve_is_refused_naming_why(tmp_path, config, message):
    path = make_adapter(tmp_path / "a", CONFIG, **config)
    with pytest.raises(ValueError, match=message):
        load_adapter(path, CONFIG, 16)


def test_a_rank_over_max_lora_rank_names_the_flag(tmp_path):
    path = make_adapter(tmp_path / "a", CONFIG, rank=32)
    with pytest.raises(ValueError, match=r"rank 32 but max_lora_rank is 16.*--max-lora-rank"):
        load_adapter(path, CONFIG, 16)


def test_an_adapter_of_another_base_model_is_refused_by_its_shapes(tmp_path):
    other = make_config("llama", hidden_size=32, intermediate_size=64)
    path = make_adapter(tmp_path / "a", other)
    with pytest.raises(ValueError, match="another base model"):
        load_adapter(path, CONFIG, 16)
    deeper = make_config("llama", num_hidden_layers=3)
    with pytest.raises(ValueError, match="the model has 2 layers"):
        load_adapter(make_adapter(tmp_path / "b", deeper), CONFIG, 16)


def test_weights_outside_the_decoder_projections_are_refused(tmp_path):
    path = make_adapter(tmp_path / "a", CONFIG)
    file = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(file)
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 131)
    save_file(tensors, file)
    with pytest.raises(ValueError, match="embed_tokens.*not a LoRA weight of a decoder layer"):
        load_adapter(path, CONFIG, 16)


def test_a_half_pair_or_a_missing_file_is_refused(tmp_path):
    path = make_adapter(tmp_path / "a", CONFIG, targets=("q_proj",))
    file = os.path.join(path, "adapter_model.safetensors")
    tensors = {k: v for k, v in load_file(file).items() if "layers.1" not in k or "lora_A" in k}
    save_file(tensors, file)
    with pytest.raises(ValueError, match="layer 1 q_proj: has lora_A without its other half"):
        load_adapter(path, CONFIG, 16)
    os.remove(file)
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        load_adapter(path, CONFIG, 16)
    with pytest.raises(ValueError, match="no adapter_config.json there"):
        load_adapter(str(tmp_path / "nowhere"), CONFIG, 16)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_adapter(path, CONFIG, 16)


def test_an_id_stays_bound_to_its_folder(tmp_path):
    adapters = CheckedAdapters(CONFIG, 16)
    a, b = make_adapter(tmp_path / "a", CONFIG), make_adapter(tmp_path / "b", CONFIG, seed=2)
    adapters.check(LoRARequest("a", 1, a))
    adapters.check(LoRARequest("a-again", 1, a))  # the same folder: fine
    with pytest.raises(ValueError, match="lora_int_id 1 already names the adapter at"):
        adapters.check(LoRARequest("b", 1, b))
    adapters.check(LoRARequest("b", 2, b))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", 1, "/p"), "lora_name must be a non-empty string"),
        (("a", 0, "/p"), "lora_int_id must be >= 1"),
        (("a", True, "/p"), "lora_int_id must be an int"),
        (("a", 1, ""), "lora_path must name the adapter's folder"),
    ],
)
def test_lora_request_checks_its_fields(args, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*args)


def test_lora_modules_take_both_of_vllms_forms():
    spec = json.dumps({"name": "b", "path": "/adapters/b", "base_model_name": "base"})
    loras = parse_lora_modules(["a=/adapters/a", spec])
    assert loras == {
        "a": LoRARequest("a", 1, "/adapters/a"),
        "b": LoRARequest("b", 2, "/adapters/b", "base"),
    }
    for bad, message in [
        (["a"], "expected name=path"),
        (["=/p"], "expected name=path"),
        (['{"name": "a"}'], "needs 'name' and 'path'"),
        (["a=/p", "a=/q"], "names adapter 'a' twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)


def test_lora_modules_are_checked_before_the_engine_starts(tmp_path):
    loras = {"a": LoRARequest("a", 1, make_adapter(tmp_path / "a", CONFIG, rank=32))}
    without_lora = EngineConfig(model_config=ModelConfig(hf_config=CONFIG))
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        check_lora_modules(loras, without_lora)
    config = EngineConfig(model_config=ModelConfig(hf_config=CONFIG), lora_config=LoRAConfig())
    with pytest.raises(ValueError, match="rank 32 but max_lora_rank is 16"):
        check_lora_modules(loras, config)
    check_lora_modules({}, without_lora)


def test_a_pooling_engine_refuses_lora(tmp_path):
    from tests.model.checkpoints import make_checkpoint
    from v1engine.engine_args import EngineArgs

    embedder = make_checkpoint(tmp_path, "llama", base_model=True)  # "auto" runs it as pooling
    with pytest.raises(ValueError, match="enable_lora serves generation only"):
        EngineArgs(embedder, enable_lora=True).create_engine_config()
    with pytest.raises(ValueError, match="enable_lora serves generation only"):
        EngineArgs(embedder, enable_lora=True, runner="pooling").create_engine_config()


def test_the_scheduler_runs_at_most_max_loras_adapters_at_once():
    scheduler = make_scheduler(max_loras=1)
    worker = make_worker(scheduler)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    scheduler.add_request(make_request("a1", [1, 2, 3], lora_request=a, max_tokens=3))
    scheduler.add_request(make_request("b1", [4, 5], lora_request=b, max_tokens=3))
    scheduler.add_request(make_request("base", [6, 7], max_tokens=3))
    scheduler.add_request(make_request("a2", [8, 9], lora_request=a, max_tokens=3))
    output, _ = run_step(scheduler, worker)
    # b1 waits for a's slot; the base model and a's second request do not wait behind it.
    assert list(output.num_scheduled_tokens) == ["a1", "base", "a2"]
    assert [r.request_id for r in scheduler.waiting] == ["b1"]
    assert [new.lora_request for new in output.scheduled_new_reqs] == [a, None, a]
    run_to_completion(scheduler, worker)
    assert all(scheduler.requests.get(r) is None for r in ("a1", "b1", "base", "a2"))


def test_an_adapter_shares_prefix_cache_blocks_only_with_itself():
    manager = _manager()
    prompt = list(range(13))  # 3 full blocks
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    for request_id, lora, expected_hit_tokens in [
        ("a1", a, 0),
        ("base", None, 0),
        ("b1", b, 0),
        ("a2", a, 12),
        ("b2", b, 12),
        ("base2", None, 12),
    ]:
        assert _prefill(manager, request_id, prompt, lora=lora)[1] == expected_hit_tokens
