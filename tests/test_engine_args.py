"""EngineArgs -> EngineConfig: the one list of each choice, and `kv_cache_dtype` reaching the
KV cache."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from tests.model.checkpoints import make_checkpoint
from v1engine.config import (
    CACHE_DTYPES,
    DEVICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    LOAD_FORMATS,
    LOGPROBS_MODES,
    MODEL_DTYPES,
    RUNNER_TYPES,
    SCHEDULING_POLICIES,
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
)
from v1engine.engine_args import EngineArgs
from v1engine.worker.gpu_model_runner import GPUModelRunner


def parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser())


def test_cli_choices_are_the_config_lists():
    choices = {action.dest: action.choices for action in parser()._actions if action.choices}
    assert choices == {
        "device": DEVICES,
        "dtype": MODEL_DTYPES + ("half", "float"),
        "kv_cache_dtype": CACHE_DTYPES,
        "distributed_executor_backend": DISTRIBUTED_EXECUTOR_BACKENDS,
        "scheduling_policy": SCHEDULING_POLICIES,
        "runner": RUNNER_TYPES,
        "logprobs_mode": LOGPROBS_MODES,
        "load_format": LOAD_FORMATS,
    }


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ModelConfig(dtype="int8"), f"dtype must be one of {MODEL_DTYPES}, got 'int8'"),
        (
            lambda: CacheConfig(cache_dtype="fp8"),
            f"cache_dtype (--kv-cache-dtype) must be one of {CACHE_DTYPES}, got 'fp8'",
        ),
        (lambda: DeviceConfig(device="tpu"), f"device must be one of {DEVICES}, got 'tpu'"),
        (
            lambda: ParallelConfig(distributed_executor_backend="mpi"),
            f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
            "got 'mpi'",
        ),
        (
            lambda: EngineArgs(runner="embed").create_engine_config(),
            f"runner must be one of {RUNNER_TYPES}, got 'embed'",
        ),
    ],
)
def test_a_value_outside_a_choice_list_names_the_list(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message


def test_kv_cache_dtype_reaches_the_cache_config():
    assert EngineArgs().create_engine_config().cache_config.cache_dtype == "auto"
    config = EngineArgs(kv_cache_dtype="float16").create_engine_config()
    assert config.cache_config.cache_dtype == "float16"
    args = parser().parse_args(["--kv-cache-dtype", "bfloat16"])
    assert EngineArgs.from_cli_args(args).kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"--kv-cache-dtype\) must be one of .*got 'fp8'"):
        EngineArgs(kv_cache_dtype="fp8").create_engine_config()


def test_cli_refuses_an_unknown_kv_cache_dtype(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--kv-cache-dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("engine_args"), "llama")


@pytest.mark.parametrize(
    ("kv_cache_dtype", "expected"),
    [("auto", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)],
)
def test_model_runner_builds_kv_specs_in_the_kv_cache_dtype(llama_path, kv_cache_dtype, expected):
    args = EngineArgs(
        model=llama_path, device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype
    )
    config = args.create_engine_config()
    runner = GPUModelRunner(config, config.model_config.hf_config, torch.device("cpu"), True)
    assert runner.kv_cache_dtype == expected  # "auto": the model's float32
    runner.load_model()
    assert {spec.dtype for spec in runner.get_kv_cache_spec().values()} == {expected}


def test_every_flag_says_what_it_does():
    from v1engine.engine_args import _HELP

    assert set(_HELP) == {f.name for f in dataclasses.fields(EngineArgs)}
    text = parser().format_help()
    assert "the KV cache's dtype (auto: the model's) (default: auto)" in " ".join(text.split())


def test_vllm_commands_spell_dtypes_and_lengths_their_way(capsys):
    args = parser().parse_args(["--dtype", "half", "--max-model-len", "32k"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.dtype, engine_args.max_model_len) == ("half", 32000)
    assert ModelConfig(dtype="half").dtype == "float16"
    assert ModelConfig(dtype="float").dtype == "float32"
    for text, value in [("4096", 4096), ("1K", 1024), ("25.6k", 25600), ("1M", 1 << 20)]:
        assert parser().parse_args(["--max-model-len", text]).max_model_len == value
    for bad in ("1.5k0", "0.0001k", "lots"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--max-model-len", bad])
        assert "--max-model-len: invalid human_readable_int value" in capsys.readouterr().err
