"""The README's offline example, run as a user runs it: pasted into a script file and started with
`python script.py` (spawned workers re-import that script, so the example must guard its entry)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.timeouts import scaled

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_the_offline_example_runs_as_a_script(tmp_path):
    with open(os.path.join(_REPO, "README.md")) as f:
        (example,) = [b for b in _python_blocks(f.read()) if "from v1engine import LLM" in b]
    script = tmp_path / "offline_example.py"
    script.write_text(example)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Paris" in done.stdout  # greedy SmolLM2-135M-Instruct knows the capital of France
