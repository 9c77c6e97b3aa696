"""RayExecutor on a simulated two-node Ray cluster (one CPU per node), so tensor parallelism
really spans two nodes: rank 1 reads its calls and sends its replies over TCP.

One cluster serves the whole module (starting one takes seconds); every executor's shutdown is
checked to leave no live actor or placement group, and the cluster's teardown that no Ray process
is left.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

pytest.importorskip("ray")

from tests.entrypoints.llm_utils import GREEDY, PROMPTS, hf_greedy, make_llm, token_ids  # noqa: E402
from tests.entrypoints.openai.server_utils import make_tiny_checkpoint  # noqa: E402
from tests.entrypoints.openai.test_rank_faults import run_fault  # noqa: E402
from tests.executor.fault_worker import FAILING_STEP_WORKER, inject_fault  # noqa: E402
from tests.executor.rpc_worker import (  # noqa: E402
    process_id,
    rank_times,
    ray_node_id,
    torch_threads,
)
from tests.executor.test_engine_rank_faults import LONG  # noqa: E402
from tests.executor.test_multiproc_executor import BIG_BYTES, make_config  # noqa: E402
from tests.executor.test_rank_faults import COLLECTIVE  # noqa: E402
from tests.model.checkpoints import load_hf_model, make_checkpoint  # noqa: E402
from tests.process_utils import wait_gone  # noqa: E402
from tests.ray_cluster import ray_leftovers, start_cluster, stop_cluster  # noqa: E402
from tests.timeouts import scaled  # noqa: E402
from tests.worker.worker_utils import expected_spin_count, worker_spin_count  # noqa: E402
from v1engine.engine.core_process import EngineDeadError  # noqa: E402
from v1engine.executor.abstract import Executor  # noqa: E402
from v1engine.executor.errors import WorkerDiedError, WorkerError  # noqa: E402
from v1engine.executor.group_executor import LOCKSTEP_GRACE_S  # noqa: E402
from v1engine.executor.ray_executor import RayExecutor  # noqa: E402
from v1engine.request import EngineCoreRequest  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = start_cluster(num_nodes=2)
    yield cluster
    left = stop_cluster(cluster)
    assert not left, f"Ray processes left after the cluster stopped: {left}"


def shut_down_cleanly(executor) -> None:
    executor.shutdown()
    left = ray_leftovers()
    assert not left, f"shutdown left Ray resources behind: {left}"


@pytest.fixture(scope="class")
def executor(ray_cluster):
    executor = RayExecutor(make_config(backend="ray"))
    yield executor
    shut_down_cleanly(executor)


def test_get_class_picks_ray():
    assert Executor.get_class(make_config(backend="ray")) is RayExecutor


class TestCalls:
    """The call semantics MultiprocExecutor has, on one executor spread over both nodes. The
    executor holds both CPUs of the cluster, so it is gone before the tests below start theirs."""

    def test_ranks_span_both_nodes_and_calls_return_per_rank(self, executor):
        import ray

        nodes = executor.collective_rpc(ray_node_id)
        assert nodes[0] == ray.get_runtime_context().get_node_id()  # rank 0 on the driver's node
        assert nodes[0] != nodes[1]
        assert executor.collective_rpc("get_rank") == [0, 1]
        assert executor.collective_rpc("get_rank", unique_reply_rank=1) == 1
        assert executor.collective_rpc(rank_times, args=(10,)) == [0, 10]

    def test_workers_get_the_multiprocess_workers_openmp_wait_policy(self, executor):
        expected = expected_spin_count()  # on every node, as for multiprocess workers
        assert executor.collective_rpc(worker_spin_count) == [expected, expected]

    def test_large_tensors_cross_nodes_both_ways(self, executor):
        tensor = torch.arange(BIG_BYTES // 4, dtype=torch.float32)
        expected = float(tensor.double().sum())
        assert executor.collective_rpc("tensor_sum", args=(tensor,)) == [expected] * 2
        for rank, result in enumerate(executor.collective_rpc("make_tensor", args=(BIG_BYTES,))):
            assert result.shape == (BIG_BYTES // 4,) and torch.all(result == rank)

    def test_unknown_method_is_rejected_before_broadcast(self, executor):
        with pytest.raises(ValueError, match="unknown RPC method"):
            executor.collective_rpc("no_such_method")
        assert executor.collective_rpc("echo", args=(7,)) == [7, 7]

    def test_worker_error_names_rank_with_traceback(self, executor):
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("raise_error", kwargs={"only_rank": 1}, unique_reply_rank=0)
        text = str(info.value)
        assert [f.rank for f in info.value.failures] == [1]
        assert "collective_rpc('raise_error')" in text and "ValueError: boom from rank 1" in text
        assert "Traceback" in text and "in raise_error" in text

    def test_timeout_names_method_and_stale_replies_are_dropped(self, executor):
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"'sleep'.*rank 0, rank 1"):
            executor.collective_rpc("sleep", args=(1.0,), timeout=0.2)
        assert time.monotonic() - start < scaled(1.0)
        assert executor.collective_rpc("echo", args=("fresh",)) == ["fresh", "fresh"]

    def test_non_block_returns_futures_completed_in_order(self, executor):
        futures = [executor.collective_rpc("echo", args=(i,), non_block=True) for i in range(8)]
        assert [f.result(timeout=scaled(30)) for f in futures] == [[i, i] for i in range(8)]
        with pytest.raises(WorkerError):
            executor.collective_rpc("raise_error", non_block=True).result(timeout=scaled(30))


def test_missing_resources_are_named_at_once(ray_cluster):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"reserve 3 x \{'CPU': 1\}.*has only 2 CPU.*ray start"):
        RayExecutor(make_config(tp=3, backend="ray"))
    assert time.monotonic() - start < scaled(10)
    assert not ray_leftovers()


def test_worker_failing_at_start_up_raises_and_leaves_nothing(ray_cluster):
    config = make_config(worker_cls="tests.executor.rpc_worker.FailingInitWorker", backend="ray")
    with pytest.raises(RuntimeError) as info:
        RayExecutor(config)
    assert "worker rank 1 failed to start" in str(info.value)
    assert "no device for rank 1" in str(info.value)
    assert not ray_leftovers()


def test_tp2_across_nodes_equals_transformers_and_survives_nothing_when_killed(
    ray_cluster, tmp_path
):
    checkpoint = make_checkpoint(tmp_path, "llama")
    llm = make_llm(checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        executor = llm.engine_core.executor
        nodes = executor.collective_rpc(ray_node_id)
        assert nodes[0] != nodes[1]
        # Each rank is alone on its (simulated) node, so it takes all of the node's cores, not
        # the half a 2-rank split of one node would give it.
        cores = len(os.sched_getaffinity(0))
        assert executor.collective_rpc(torch_threads) == [cores, cores]
        got = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert got == hf_greedy(load_hf_model(checkpoint), PROMPTS, GREEDY.max_tokens)

        # Kill rank 1's process (on the other node) in the middle of a generation.
        pids = executor.collective_rpc(process_id)
        core = llm.engine_core
        for i, prompt in enumerate(PROMPTS):
            core.add_request(EngineCoreRequest(f"kill-{i}", prompt, GREEDY))
        core.step()
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker rank 1 died .*Ray actor died"):
            while time.monotonic() - killed_at < 30:
                core.step()
        assert time.monotonic() - killed_at < scaled(5.0)
    finally:
        llm.shutdown()
    assert not ray_leftovers()
    wait_gone(pids, limit_s=10)  # Ray reaps killed actors' processes asynchronously


def test_a_rank_failing_in_a_step_fails_at_once_and_ends_the_group(ray_cluster):
    # Rank 0 waits for rank 1 in a real gloo all-reduce across the two nodes.
    executor = RayExecutor(make_config(worker_cls=COLLECTIVE, backend="ray"))
    try:
        assert executor.execute_model((None, True)) == 2
        pids = executor.collective_rpc(process_id)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"(?s)rank 0 did not answer.*fault on rank 1"):
            executor.execute_model((1, True))
        assert time.monotonic() - start < LOCKSTEP_GRACE_S + scaled(2)
        with pytest.raises(WorkerDiedError, match="worker rank 1 .*'get_rank'"):
            executor.collective_rpc("get_rank")
    finally:
        shut_down_cleanly(executor)
    wait_gone(pids, limit_s=scaled(10))


def test_llm_on_ray_fails_naming_rank_1_when_it_raises_mid_generation(ray_cluster, tmp_path):
    checkpoint = make_checkpoint(tmp_path, "llama")
    llm = make_llm(
        checkpoint,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        worker_cls=FAILING_STEP_WORKER,
    )
    try:
        pids = llm.engine_core.executor.collective_rpc(process_id)
        inject_fault(checkpoint, "raise", after_steps=3)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"(?s)failed on rank 1.*injected fault"):
            llm.generate(PROMPTS, LONG, use_tqdm=False)
        assert time.monotonic() - start < scaled(5)
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            llm.generate(PROMPTS[:1], LONG, use_tqdm=False)
    finally:
        llm.shutdown()
    assert not ray_leftovers()
    wait_gone(pids, limit_s=scaled(10))


@pytest.mark.parametrize("action", ["raise", "kill"])
def test_server_on_ray_ends_every_stream_and_exits_when_rank_1_fails(ray_cluster, tmp_path, action):
    # The server joins this module's cluster (start_cluster set RAY_TMPDIR, where Ray keeps
    # the cluster's address), so its ranks span the two simulated nodes.
    model_dir = make_tiny_checkpoint(str(tmp_path / "model"))
    log = run_fault(model_dir, str(tmp_path), action, "--distributed-executor-backend", "ray")
    assert "Ray executor: 2 rank(s) on 2 node(s)" in log
    assert not ray_leftovers()


def test_node_death_fails_calls_naming_the_rank(ray_cluster):
    # Last in the module: it takes the second node away.
    executor = RayExecutor(make_config(backend="ray"))
    try:
        pending = executor.collective_rpc("sleep", args=(60.0,), non_block=True)
        (worker_node,) = [n for n in ray_cluster.cluster.list_all_nodes() if not n.head]
        removed_at = time.monotonic()
        ray_cluster.cluster.remove_node(worker_node)
        with pytest.raises(WorkerDiedError, match="worker rank 1 died .*its node has died"):
            pending.result(timeout=scaled(30))
        assert time.monotonic() - removed_at < scaled(5.0)
        with pytest.raises(WorkerDiedError, match="rank 1"):
            executor.collective_rpc("get_rank")
    finally:
        shut_down_cleanly(executor)
