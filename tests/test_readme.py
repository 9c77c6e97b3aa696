"""The README's offline and asyncio examples, each run as a user runs it: pasted into a script
file and started with `python script.py` (spawned workers re-import that script, so the example
must guard its entry)."""

from __future__ import annotations

import glob
import os
import re

from tests.process_utils import ROOT, run_script


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_the_offline_example_runs_as_a_script(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = _python_blocks(f.read())
    (example,) = [
        b
        for b in blocks
        if "from v1engine import LLM" in b and "profile" not in b and "_sync" not in b
    ]
    script = tmp_path / "offline_example.py"
    script.write_text(example)
    done = run_script(str(script), cwd=str(tmp_path))
    assert "Paris" in done.stdout  # greedy SmolLM2-135M-Instruct knows the capital of France


def test_the_asyncio_example_runs_as_a_script(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        (example,) = [b for b in _python_blocks(f.read()) if "AsyncLLM.from_engine_args" in b]
    script = tmp_path / "asyncio_example.py"
    script.write_text(example)
    assert "Paris" in run_script(str(script), cwd=str(tmp_path)).stdout


def test_the_profiling_example_writes_a_trace(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        (example,) = [b for b in _python_blocks(f.read()) if "start_profile" in b]
    script = tmp_path / "profiling_example.py"
    script.write_text(example)
    run_script(str(script), cwd=str(tmp_path))
    assert glob.glob(str(tmp_path / "traces" / "rank0.*.pt.trace.json.gz"))
    assert glob.glob(str(tmp_path / "traces" / "rank0.*.txt"))


def test_the_weight_update_example_loads_the_weights(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        (example,) = [b for b in _python_blocks(f.read()) if "reload_weights" in b]
    script = tmp_path / "weights_example.py"
    script.write_text(example)
    assert "Paris" in run_script(str(script), cwd=str(tmp_path)).stdout  # not dummy weights'
