"""UniProcExecutor: the same contract with the worker in this process."""

from __future__ import annotations

import pytest

from tests.executor.rpc_worker import rank_times
from tests.executor.test_multiproc_executor import make_config
from v1engine.executor.errors import WorkerError
from v1engine.executor.uniproc_executor import UniProcExecutor


@pytest.fixture
def executor():
    executor = UniProcExecutor(make_config(tp=1, backend="uni"))
    yield executor
    executor.shutdown()


def test_calls_return_one_result_per_rank(executor):
    assert executor.collective_rpc("get_rank") == [0]
    assert executor.collective_rpc("echo", args=(5,), unique_reply_rank=0) == 5
    assert executor.collective_rpc(rank_times, args=(3,)) == [0]
    assert executor.collective_rpc("echo", args=(1,), non_block=True).result() == [1]


def test_errors_match_the_multiprocess_executor(executor):
    with pytest.raises(ValueError, match="unknown RPC method"):
        executor.collective_rpc("nope")
    with pytest.raises(WorkerError, match="rank 0") as info:
        executor.collective_rpc("raise_error")
    assert "Traceback" in str(info.value)
    future = executor.collective_rpc("raise_error", non_block=True)
    with pytest.raises(WorkerError):
        future.result()
    executor.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        executor.collective_rpc("get_rank")
