"""LLM.start_profile / stop_profile (vLLM's profiler_config): every rank's torch.profiler trace of
real steps, and the errors of a profile that is off, running twice or never started."""

from __future__ import annotations

import glob
import gzip
import json
import os

import pytest

from tests.entrypoints.llm_utils import GREEDY, PROMPTS, make_llm, token_ids
from v1engine.config import ProfilerConfig
from v1engine.engine_args import EngineArgs


def _trace_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_each_rank_writes_a_trace_of_the_steps_it_ran(llama_checkpoint, tmp_path):
    traces = tmp_path / "traces"
    config = {"profiler": "torch", "torch_profiler_dir": str(traces)}
    llm = make_llm(llama_checkpoint, tensor_parallel_size=2, profiler_config=config)
    try:
        unprofiled = token_ids(llm.generate(PROMPTS, GREEDY))
        llm.start_profile(profile_prefix="decode")
        with pytest.raises(RuntimeError, match="a profile is already running"):
            llm.start_profile()  # the running profile goes on
        profiled = token_ids(llm.generate(PROMPTS, GREEDY))
        llm.stop_profile()
        with pytest.raises(RuntimeError, match="no profile is running"):
            llm.stop_profile()
        assert profiled == unprofiled  # recording changes no token
    finally:
        llm.shutdown()
    for rank in (0, 1):
        (trace,) = glob.glob(str(traces / f"decode_rank{rank}.*.pt.trace.json.gz"))
        names = {event.get("name", "") for event in _trace_events(trace)}
        # torch's ops, and (with stacks, the default) the model's Python frames around them.
        assert any(name.startswith("aten::") for name in names)
        assert any("v1engine/model/models/llama.py" in name for name in names)
        (table,) = glob.glob(str(traces / f"decode_rank{rank}.*.txt"))
        assert "Self CPU" in open(table).read()


def test_a_second_profile_gets_its_own_files_and_gzip_can_be_turned_off(llama_checkpoint, tmp_path):
    config = ProfilerConfig("torch", str(tmp_path), torch_profiler_use_gzip=False)
    llm = make_llm(llama_checkpoint, profiler_config=config)
    try:
        for _ in range(2):
            llm.start_profile()
            llm.generate(PROMPTS[:1], GREEDY)
            llm.stop_profile()
    finally:
        llm.shutdown()
    traces = sorted(glob.glob(str(tmp_path / "rank0.*.pt.trace.json")))
    assert len(traces) == 2
    assert all(_trace_events(trace) for trace in traces)


def test_a_rank_that_cannot_write_its_trace_is_named(llama_checkpoint, tmp_path):
    blocked = tmp_path / "traces"
    config = {"profiler": "torch", "torch_profiler_dir": str(blocked)}
    llm = make_llm(llama_checkpoint, profiler_config=config)
    try:
        blocked.write_text("a file where the folder should be")  # after the config's check
        with pytest.raises(RuntimeError, match="failed on rank 0") as info:
            llm.start_profile()
        assert "FileExistsError" in str(info.value)  # the rank's own error and traceback
        assert token_ids(llm.generate(PROMPTS[:1], GREEDY))  # the engine still serves
    finally:
        llm.shutdown()


def test_profiling_off_says_how_to_turn_it_on(llama_checkpoint):
    llm = make_llm(llama_checkpoint)
    try:
        for call in (llm.start_profile, llm.stop_profile):
            with pytest.raises(RuntimeError, match="profiling is off: .*torch_profiler_dir"):
                call()
        assert token_ids(llm.generate(PROMPTS[:1], GREEDY))  # the engine still serves
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "config, match",
    [
        ({"profiler": "cuda", "torch_profiler_dir": "x"}, "must be one of \\(None, 'torch'\\)"),
        ({"profiler": "torch"}, "needs \"torch_profiler_dir\""),
        ({"profiler": "torch", "dir": "x"}, "unknown profiler_config key.*'dir'.*valid ones"),
        ({"profiler": "torch", "torch_profiler_dir": "x", "torch_profiler_with_stack": "no"},
         "torch_profiler_with_stack must be true or false"),
        ({"profiler": "torch", "torch_profiler_dir": __file__}, "is a file; give a folder"),
    ],
)  # fmt: skip
def test_a_bad_profiler_config_fails_before_any_process_starts(config, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(profiler_config=config).create_engine_config()


def test_the_trace_dir_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = EngineArgs(profiler_config={"profiler": "torch", "torch_profiler_dir": "t"})
    profiler_dir = config.create_engine_config().profiler_config.torch_profiler_dir
    assert profiler_dir == os.path.join(str(tmp_path), "t")
