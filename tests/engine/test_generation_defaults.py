"""The model's generation_config.json as sampling defaults (vLLM's `--generation-config`): which
values count, where they come from, what a bad file says, and how a request's own fields and
max_tokens meet them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.model.checkpoints import make_checkpoint
from v1engine.engine.generation_defaults import load_sampling_defaults
from v1engine.engine_args import EngineArgs
from v1engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

# As Qwen2.5's file has it, plus values equal to transformers' defaults (which do not count).
QWEN_LIKE = {
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}


def _folder(tmp_path, values) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    return str(tmp_path)


def test_only_values_that_differ_from_transformers_defaults_count(tmp_path):
    folder = _folder(tmp_path, {**QWEN_LIKE, "max_new_tokens": 64})
    assert load_sampling_defaults(folder, None) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 64,
    }
    restated = _folder(tmp_path, {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None})
    assert load_sampling_defaults(restated, None) == {}


def test_auto_reads_the_models_own_file_and_vllm_none(tmp_path):
    model = Path(make_checkpoint(tmp_path, "llama"))
    assert load_sampling_defaults("auto", str(model)) == {}  # transformers' file: token ids only
    _folder(model, QWEN_LIKE)

    def defaults(**engine_args):
        config = EngineArgs(model=str(model), **engine_args).create_engine_config()
        return config.model_config.sampling_defaults

    assert defaults()["temperature"] == 0.7
    assert defaults(generation_config="vllm") == {}


def test_a_bad_source_or_file_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="has no generation_config.json.*'auto'.*'vllm'"):
        load_sampling_defaults(str(tmp_path), None)
    with pytest.raises(ValueError, match="temperature must be >= 0.*generation_config='vllm'"):
        load_sampling_defaults(_folder(tmp_path, {"temperature": -1.0}), None)
    with pytest.raises(ValueError, match="not a JSON object"):
        load_sampling_defaults(_folder(tmp_path, [1, 2]), None)


def test_overrides_set_file_keys_over_the_file_whatever_their_value(tmp_path):
    folder = _folder(tmp_path, QWEN_LIKE)
    overrides = {"temperature": 1.0, "max_new_tokens": 5}  # 1.0: set, though transformers'
    defaults = load_sampling_defaults(folder, None, overrides)
    assert (defaults["temperature"], defaults["max_tokens"], defaults["top_k"]) == (1.0, 5, 20)
    assert load_sampling_defaults("vllm", None, {"top_p": 0.5}) == {"top_p": 0.5}
    with pytest.raises(ValueError, match=r"keys \['do_sample'\] are not.*use temperature, top_p"):
        load_sampling_defaults("vllm", None, {"do_sample": True})
    with pytest.raises(
        ValueError,
        match="override_generation_config: SamplingParams.top_p must be.*fix the override",
    ):
        load_sampling_defaults(folder, None, {"top_p": 2.0})


def test_the_override_flag_takes_a_json_object(tmp_path, capsys):
    from v1engine.serve import make_arg_parser

    parser = make_arg_parser()
    flag = "--override-generation-config"
    args = parser.parse_args([flag, '{"temperature": 0.5}'])
    assert EngineArgs.from_cli_args(args).override_generation_config == {"temperature": 0.5}
    assert parser.parse_args([]).override_generation_config is None
    args = parser.parse_args(["--hf-overrides", '{"max_position_embeddings": 64}'])
    assert EngineArgs.from_cli_args(args).hf_overrides == {"max_position_embeddings": 64}
    for bad in ("[1]", "{temperature: 0.5}"):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, bad])
        assert flag in capsys.readouterr().err


def test_a_requests_own_fields_win_and_max_new_tokens_caps(tmp_path):
    defaults = {"temperature": 0.7, "top_k": 20, "min_p": 0.05, "max_tokens": 10}
    plain = CompletionRequest.model_validate({"prompt": "hi"}).to_sampling_params(100, defaults)
    assert (plain.temperature, plain.top_k, plain.min_p, plain.top_p) == (0.7, 20, 0.05, 1.0)
    assert plain.max_tokens == 10  # completions' 16, capped
    own = {"prompt": "hi", "temperature": 0.0, "top_k": 0, "max_tokens": 4}
    params = CompletionRequest.model_validate(own).to_sampling_params(100, defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 0, 4)
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert chat.to_sampling_params(100, defaults).max_tokens == 10  # the context's 100, capped
    assert chat.to_sampling_params(100).max_tokens == 100
    assert chat.to_sampling_params(100).temperature == 1.0
