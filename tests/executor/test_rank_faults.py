"""A rank that fails while its peers wait for it in a collective (vLLM issue #23985), with real
processes in a real gloo group (CollectiveWorker): the call fails once the others had their grace
to answer (short for a lockstep call such as a step, longer for a user's method), names the rank,
and the group is ended with no process left; a failure that strands no rank leaves the executor
usable.
"""

from __future__ import annotations

import time

import pytest

from tests.executor.rpc_worker import process_id
from tests.executor.test_multiproc_executor import make_config
from tests.process_utils import wait_gone
from tests.timeouts import scaled
from v1engine.executor.errors import WorkerDiedError, WorkerError
from v1engine.executor.group_executor import LOCKSTEP_GRACE_S, PEER_GRACE_S
from v1engine.executor.multiproc_executor import MultiprocExecutor

COLLECTIVE = "tests.executor.rpc_worker.CollectiveWorker"


@pytest.fixture
def executor(request):
    tp = getattr(request, "param", 2)
    executor = MultiprocExecutor(make_config(tp=tp, worker_cls=COLLECTIVE))
    yield executor
    executor.shutdown()


def assert_group_ended(executor, pids: list[int], failed_rank: int = 1) -> None:
    wait_gone(pids, scaled(5))
    with pytest.raises(WorkerDiedError, match=f"worker rank {failed_rank} .*'get_rank'"):
        executor.collective_rpc("get_rank")


@pytest.mark.parametrize("executor", [2, 3], indirect=True)
def test_a_step_failing_on_one_rank_fails_within_its_grace_and_ends_the_group(executor):
    world_size = executor.world_size
    assert executor.execute_model((None, True)) == world_size  # the all-reduce works
    pids = executor.collective_rpc(process_id)
    start = time.monotonic()
    failing = executor.execute_model((1, True), non_block=True)
    queued = executor.collective_rpc("get_rank", non_block=True)  # sent behind the step
    with pytest.raises(WorkerError) as info:
        failing.result(timeout=scaled(30))
    # The other ranks never answer (they wait in the all-reduce): only the short grace.
    assert LOCKSTEP_GRACE_S <= time.monotonic() - start < LOCKSTEP_GRACE_S + scaled(2)
    text = str(info.value)
    assert [f.rank for f in info.value.failures] == [1]
    assert "collective_rpc('execute_model') failed on rank 1" in text
    assert "RuntimeError: injected fault on rank 1" in text and "Traceback" in text
    silent = ", ".join(f"rank {r}" for r in range(world_size) if r != 1)
    assert f"{silent} did not answer" in text and "stopped every worker" in text
    assert info.value.summary == (
        "collective_rpc('execute_model') failed on rank 1 (RuntimeError: injected fault on rank 1)"
    )
    with pytest.raises(WorkerDiedError, match="worker rank 1 .*'get_rank'"):
        queued.result(timeout=scaled(5))
    assert_group_ended(executor, pids)


def test_a_failed_step_that_strands_no_rank_leaves_the_group_usable(executor):
    # Rank 1 fails and rank 0 returns without a collective: every rank answered, so none can
    # be stuck.
    with pytest.raises(WorkerError) as info:
        executor.execute_model((1, False))
    assert [f.rank for f in info.value.failures] == [1]
    assert "did not answer" not in str(info.value)
    assert executor.execute_model((None, True)) == 2


@pytest.mark.parametrize("timeout", [None, 1.0])
def test_a_user_call_stranding_a_rank_fails_once_the_grace_is_over(executor, timeout):
    pids = executor.collective_rpc(process_id)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        executor.collective_rpc("all_reduce_unless", args=(1,), timeout=timeout)
    elapsed = time.monotonic() - start
    # A user's method may fail on every rank alike, so the others get a grace (or the
    # call's own timeout, if shorter) to answer before they are presumed stuck.
    grace = PEER_GRACE_S if timeout is None else timeout
    assert grace <= elapsed < grace + scaled(2)
    assert "rank 0 did not answer" in str(info.value)
    assert "injected fault on rank 1" in str(info.value)
    assert_group_ended(executor, pids)


def test_failures_that_strand_no_rank_leave_the_group_usable(executor):
    # Every rank fails alike (a bad argument, say): every rank is named.
    with pytest.raises(WorkerError) as info:
        executor.collective_rpc("raise_error", args=("bad",))
    assert [f.rank for f in info.value.failures] == [0, 1]
    # One rank fails and the other answers: nothing stopped.
    with pytest.raises(WorkerError) as info:
        executor.collective_rpc("raise_error", kwargs={"only_rank": 1})
    assert [f.rank for f in info.value.failures] == [1]
    assert "did not answer" not in str(info.value)
    assert executor.collective_rpc("all_reduce_unless", args=(None,)) == [2, 2]
    assert executor.execute_model((None, True)) == 2
