"""The one knob for every time limit in the tests.

Tests wait on events, never on sleeps, and every limit they give (a process that must be gone, an
error that must arrive, a server that must start) is `scaled(seconds)`: the value chosen for a
quiet 2-core machine, multiplied by `V1ENGINE_TEST_TIMEOUT_SCALE` (default 1). A CI runner whose
cores are shared raises the scale instead of anyone editing limits; `scripts/stress_suite.sh`
sets it for its loaded runs. A limit that says how fast the engine must react (an error within
2 s) is a behaviour the engine promises, so it is scaled too rather than dropped.
"""

from __future__ import annotations

import os


def timeout_scale() -> float:
    value = os.environ.get("V1ENGINE_TEST_TIMEOUT_SCALE", "1")
    try:
        scale = float(value)
    except ValueError:
        raise ValueError(
            f"V1ENGINE_TEST_TIMEOUT_SCALE must be a number (e.g. 3), got {value!r}"
        ) from None
    if scale <= 0:
        raise ValueError(f"V1ENGINE_TEST_TIMEOUT_SCALE must be > 0, got {scale}")
    return scale


def scaled(seconds: float) -> float:
    """`seconds` times the suite's timeout scale."""
    return seconds * timeout_scale()


def failed_start_limit() -> float:
    """How long a start-up that fails (a worker raising while it loads) may take to be reported:
    it includes spawning and importing every process, which a machine with many test processes
    at once (a GPU box running the suite 14 files at a time took 33 s) slows far more than
    anything else, so the bound is a quarter of the worker start-up timeout it proves is not
    waited out, not a speed."""
    from v1engine.process import WORKER_STARTUP_TIMEOUT_S

    return scaled(WORKER_STARTUP_TIMEOUT_S / 4)
