"""MultiprocExecutor.collective_rpc with real worker processes (the RPCTestWorker class)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch

from tests.executor.rpc_worker import RPCTestWorker, rank_times
from tests.process_utils import alive
from tests.timeouts import failed_start_limit, scaled
from v1engine.config import EngineConfig, ParallelConfig
from v1engine.executor.abstract import Executor
from v1engine.executor.errors import WorkerDiedError, WorkerError
from v1engine.executor.multiproc_executor import MultiprocExecutor

WORKER = "tests.executor.rpc_worker.RPCTestWorker"
BIG_BYTES = 12 * 1024 * 1024  # over the 10 MB ring threshold


def make_config(tp: int = 2, worker_cls: str = WORKER, backend: str = "mp") -> EngineConfig:
    return EngineConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, worker_cls=worker_cls, distributed_executor_backend=backend
        )
    )


@pytest.fixture(scope="module")
def shared_executor():
    executor = MultiprocExecutor(make_config())
    yield executor
    executor.shutdown()


@pytest.fixture
def executor():
    executor = MultiprocExecutor(make_config())
    yield executor
    executor.shutdown()


def test_results_per_rank_and_unique_reply_rank(shared_executor):
    assert shared_executor.collective_rpc("get_rank") == [0, 1]
    assert shared_executor.collective_rpc("echo", kwargs={"value": "x"}) == ["x", "x"]
    assert shared_executor.collective_rpc("get_rank", unique_reply_rank=1) == 1


def test_module_level_function_runs_with_the_worker(shared_executor):
    assert shared_executor.collective_rpc(rank_times, args=(10,)) == [0, 10]
    # A method given as Class.method travels by its import path, like a function.
    assert shared_executor.collective_rpc(RPCTestWorker.echo, args=(5,)) == [5, 5]


def test_local_function_is_rejected(shared_executor):
    with pytest.raises(ValueError, match="module-level function"):
        shared_executor.collective_rpc(lambda worker: 1)


def test_function_the_workers_cannot_import_fails_the_call_not_the_workers(
    shared_executor, tmp_path, monkeypatch
):
    # Importable here, not in the workers (started before this directory joined sys.path):
    # like a function defined under `if __name__ == "__main__":` of the user's script.
    (tmp_path / "only_in_parent.py").write_text("def probe(worker):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_in_parent

    with pytest.raises(WorkerError) as info:
        shared_executor.collective_rpc(only_in_parent.probe)
    message = str(info.value)
    assert "only_in_parent.probe" in message and "cannot be imported in this process" in message
    assert "rank 0" in message and "rank 1" in message
    assert shared_executor.collective_rpc("echo", args=(3,)) == [3, 3]


@pytest.mark.parametrize("method", ["no_such_method", "_private_helper", "rank"])
def test_unknown_method_is_rejected_before_broadcast(shared_executor, method):
    with pytest.raises(ValueError, match="unknown RPC method"):
        shared_executor.collective_rpc(method)
    # Nothing reached the workers: the next call gets exactly its own replies.
    assert shared_executor.collective_rpc("echo", args=(7,)) == [7, 7]


def test_worker_exception_names_every_failing_rank_with_traceback(shared_executor):
    with pytest.raises(WorkerError) as info:
        shared_executor.collective_rpc("raise_error", args=("kaput",))
    text = str(info.value)
    assert "collective_rpc('raise_error')" in text
    assert "rank 0" in text and "rank 1" in text
    assert "ValueError: kaput from rank 0" in text and "kaput from rank 1" in text
    assert "Traceback" in text and "in raise_error" in text
    assert [f.rank for f in info.value.failures] == [0, 1]
    assert shared_executor.collective_rpc("get_rank") == [0, 1]


def test_one_failing_rank_is_reported_even_with_unique_reply_rank(shared_executor):
    with pytest.raises(WorkerError) as info:
        shared_executor.collective_rpc("raise_error", kwargs={"only_rank": 1}, unique_reply_rank=0)
    assert [f.rank for f in info.value.failures] == [1]
    assert "rank 0" not in str(info.value).split(":")[0]


def test_unpicklable_result_becomes_a_worker_error(shared_executor):
    with pytest.raises(WorkerError, match="rank 0"):
        shared_executor.collective_rpc("unpicklable_result")
    assert shared_executor.collective_rpc("echo", args=(1,)) == [1, 1]


def test_timeout_names_method_and_ranks_and_stale_replies_are_dropped(shared_executor):
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        shared_executor.collective_rpc("sleep", args=(1.0,), timeout=0.2)
    assert time.monotonic() - start < scaled(1.0)
    assert "'sleep'" in str(info.value) and "rank 0, rank 1" in str(info.value)
    # The late replies of `sleep` (the ranks) must never be returned for this call.
    assert shared_executor.collective_rpc("echo", args=("fresh",)) == ["fresh", "fresh"]


def test_large_tensor_argument_and_result(shared_executor):
    tensor = torch.arange(BIG_BYTES // 4, dtype=torch.float32)
    expected = float(tensor.double().sum())
    assert shared_executor.collective_rpc("tensor_sum", args=(tensor,)) == [expected] * 2
    results = shared_executor.collective_rpc("make_tensor", args=(BIG_BYTES,))
    for rank, result in enumerate(results):
        assert result.shape == (BIG_BYTES // 4,)
        assert torch.all(result == rank)


def test_non_block_returns_futures_completed_in_order(shared_executor):
    futures = [shared_executor.collective_rpc("echo", args=(i,), non_block=True) for i in range(8)]
    assert [f.result(timeout=scaled(30)) for f in futures] == [[i, i] for i in range(8)]
    failing = shared_executor.collective_rpc("raise_error", non_block=True)
    with pytest.raises(WorkerError):
        failing.result(timeout=scaled(30))


def test_concurrent_callers_get_their_own_replies(shared_executor):
    results: dict[int, list] = {}

    def caller(i: int) -> None:
        results[i] = [shared_executor.collective_rpc("echo", args=((i, j),)) for j in range(20)]

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(4):
        assert results[i] == [[(i, j), (i, j)] for j in range(20)]


def test_sigkill_of_a_worker_mid_call_fails_pending_and_later_calls(executor):
    pids = executor.collective_rpc("get_pid")
    pending = executor.collective_rpc("sleep", args=(30.0,), non_block=True)
    time.sleep(0.2)
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDiedError) as info:
        pending.result(timeout=scaled(10))
    assert time.monotonic() - killed_at < scaled(2.0)
    assert "rank 1" in str(info.value) and "SIGKILL" in str(info.value)
    assert "'sleep'" in str(info.value)
    with pytest.raises(WorkerDiedError, match="rank 1"):
        executor.collective_rpc("get_rank")


def test_worker_exiting_by_itself_is_reported_with_its_exit_code(executor):
    with pytest.raises(WorkerDiedError, match="exit code 3"):
        executor.collective_rpc("exit_now", args=(3,), timeout=10)


def test_worker_failing_at_start_up_raises_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        MultiprocExecutor(make_config(worker_cls="tests.executor.rpc_worker.FailingInitWorker"))
    assert time.monotonic() - start < failed_start_limit()
    assert "worker rank 1 failed to start" in str(info.value)
    assert "no device for rank 1" in str(info.value) and "Traceback" in str(info.value)


def test_bad_worker_cls_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot import module"):
        MultiprocExecutor(make_config(worker_cls="no_such_module.Worker"))
    with pytest.raises(ValueError, match="has no class"):
        MultiprocExecutor(make_config(worker_cls="tests.executor.rpc_worker.Nope"))


def test_shutdown_is_idempotent_and_later_calls_fail(executor):
    pids = executor.collective_rpc("get_pid")
    executor.shutdown()
    executor.shutdown()
    for pid in pids:
        assert not alive(pid)
    with pytest.raises(RuntimeError, match="shut down"):
        executor.collective_rpc("get_rank")


def test_get_class_picks_the_backend():
    assert Executor.get_class(make_config(backend="mp")) is MultiprocExecutor
    from v1engine.executor.uniproc_executor import UniProcExecutor

    assert Executor.get_class(make_config(tp=1, backend="uni")) is UniProcExecutor


def test_ray_backend_without_ray_says_how_to_install(monkeypatch):
    # None in sys.modules makes `import ray` fail as if Ray were not installed.
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delitem(sys.modules, "v1engine.executor.ray_executor", raising=False)
    with pytest.raises(ValueError, match=r"pip install 'v1engine\[ray\]'"):
        Executor.get_class(make_config(backend="ray"))


def test_shutdown_escalates_to_sigkill_for_a_wedged_worker(executor, monkeypatch):
    from tests.executor.rpc_worker import ignore_sigterm_and_sleep
    from v1engine import process

    # The same escalation with shorter steps (5 s, then 7 s twice, in the library).
    monkeypatch.setattr(process, "GRACEFUL_STOP_S", 1.0)
    monkeypatch.setattr(process, "TERMINATE_STOP_S", 1.5)
    pids = executor.collective_rpc("get_pid")
    executor.collective_rpc(ignore_sigterm_and_sleep, args=(120.0,), non_block=True)
    time.sleep(0.3)
    start = time.monotonic()
    executor.shutdown()
    assert time.monotonic() - start < scaled(20)
    for pid in pids:
        assert not alive(pid)
