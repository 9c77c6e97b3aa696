"""A fault on rank 1 of a TP=2 engine in the middle of a generation (vLLM issue #23985), through
the LLM API with its in-process engine core: rank 1 raises in execute_model, or is SIGKILLed.
The generation fails naming rank 1 within seconds, no worker is left, and the engine stays dead.
"""

from __future__ import annotations

import time

import pytest

from tests.entrypoints.llm_utils import PROMPTS, make_llm
from tests.executor.fault_worker import FAILING_STEP_WORKER, inject_fault
from tests.executor.rpc_worker import process_id
from tests.model.checkpoints import make_checkpoint
from tests.process_utils import wait_gone
from tests.timeouts import scaled
from v1engine.engine.core_process import EngineDeadError
from v1engine.executor.errors import WorkerError
from v1engine.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "action, error, match",
    [
        ("raise", WorkerError, r"(?s)'execute_model'\) failed on rank 1.*injected fault"),
        ("kill", EngineDeadError, "worker rank 1 died .*SIGKILL.*'execute_model'"),
    ],
)
def test_llm_generation_fails_naming_rank_1_and_the_engine_stays_dead(
    tmp_path, action, error, match
):
    checkpoint = make_checkpoint(tmp_path, "llama")
    llm = make_llm(checkpoint, tensor_parallel_size=2, worker_cls=FAILING_STEP_WORKER)
    try:
        pids = llm.engine_core.executor.collective_rpc(process_id)
        inject_fault(checkpoint, action, after_steps=3)  # mid-way: every prompt is running
        start = time.monotonic()
        with pytest.raises(error, match=match):
            llm.generate(PROMPTS, LONG, use_tqdm=False)
        assert time.monotonic() - start < scaled(5)
        wait_gone(pids, scaled(5))
        with pytest.raises(EngineDeadError, match="worker rank 1 died"):
            llm.generate(PROMPTS[:1], LONG, use_tqdm=False)
    finally:
        llm.shutdown()
