"""The engine-core clients and the core process (core/core_proc.py) behind them, with real
processes: a core process and two workers of the model-free CountingWorker, which generates
(last token + 1) % VOCAB_SIZE.

Resources the core process creates are named after its pid, not this one, so the leak fixture
cannot see them: tests that stop or kill an engine check them by name (`wait_no_leftovers`).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import pytest

from tests.core.counting_worker import (
    MAX_MODEL_LEN,
    expected_tokens,
    make_config,
    rank_times,
)
from tests.engine.core_utils import collect, core_request
from tests.engine.sync_client import SyncMPClient
from tests.process_utils import alive, start_json_script, wait_gone, wait_no_leftovers
from tests.timeouts import failed_start_limit, scaled
from v1engine.core_protocol import EngineCoreRequestType, encode
from v1engine.engine.core_client import (
    AsyncMPClient,
    EngineCoreClient,
    EngineDeadError,
    InprocClient,
)
from v1engine.executor.errors import WorkerError
from v1engine.request import EngineCoreRequest
from v1engine.sampling_params import SamplingParams

DEAD_WITHIN_S = scaled(2.0)


@pytest.fixture(scope="module")
def client():
    """One engine for the tests that leave it usable (module scope: started before the leak
    check of the first test, so it is not counted against it)."""
    client = SyncMPClient(make_config())
    yield client
    client.shutdown()


# -- requests ---------------------------------------------------------------------------------
def test_requests_round_trip_with_the_workers_tokens(client):
    prompts = {"a": [1, 2, 3], "b": [7], "c": list(range(20, 50))}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        client.add_request(core_request(request_id, prompt, max_tokens=3 + i))
    results = collect(client, set(prompts))
    for i, (request_id, prompt) in enumerate(prompts.items()):
        assert results[request_id] == (expected_tokens(prompt, 3 + i), "length")


def test_abort_stops_a_request(client):
    client.collective_rpc("set_step_delay", args=(0.01,))
    try:
        client.add_request(core_request("long", [1], max_tokens=50))
        while not any(
            o.request_id == "long" for o in client.get_output(timeout=scaled(10)).outputs
        ):
            pass
        client.abort_requests(["long"])
        client.add_request(core_request("short", [9], max_tokens=3))
        results = collect(client, {"short"})
    finally:
        client.collective_rpc("set_step_delay", args=(0.0,))
    assert results["short"] == (expected_tokens([9], 3), "length")
    # Tokens already in flight may arrive, but the request never runs to its end.
    assert results.get("long", ([], None))[1] is None
    assert len(results.get("long", ([], None))[0]) < 40
    client.add_request(core_request("long", [1], max_tokens=2))  # the id is free again
    assert collect(client, {"long"})["long"] == (expected_tokens([1], 2), "length")


def test_bad_input_raises_value_error_and_changes_nothing(client):
    with pytest.raises(ValueError, match="prompt is empty"):
        client.add_request(core_request("empty", []))
    with pytest.raises(ValueError, match="max_model_len is 64"):
        client.add_request(core_request("long", [1] * MAX_MODEL_LEN))
    params = SamplingParams()
    params.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        client.add_request(EngineCoreRequest("hot", [1], params))
    client.collective_rpc("set_step_delay", args=(0.01,))
    try:
        client.add_request(core_request("dup", [1], max_tokens=50))
        with pytest.raises(ValueError, match="already in use"):
            client.add_request(core_request("dup", [1]))
        client.abort_requests(["dup"])
    finally:
        client.collective_rpc("set_step_delay", args=(0.0,))
    client.add_request(core_request("ok", [4, 5], max_tokens=3))
    assert collect(client, {"ok"})["ok"] == (expected_tokens([4, 5], 3), "length")


def test_a_request_the_core_refuses_finishes_as_aborted(client):
    # Past the client's checks (sent raw), the core's own check is the safety net.
    client._send(encode(EngineCoreRequestType.ADD, core_request("raw", [])))
    outputs = client.get_output(timeout=scaled(10)).outputs
    assert [(o.request_id, str(o.finish_reason)) for o in outputs] == [("raw", "abort")]


# -- utility calls ----------------------------------------------------------------------------
def test_collective_rpc_through_the_client(client):
    pids = client.collective_rpc("get_pid")
    assert len(set(pids)) == 2 and client.core_pid not in pids and os.getpid() not in pids
    echoed = client.collective_rpc("echo", args=("x",), kwargs={"suffix": "!"}, unique_reply_rank=1)
    assert echoed == ["x", "!", 1]
    assert client.collective_rpc(rank_times, args=(3,)) == [0, 3]
    assert client.reset_prefix_cache() is True


def test_collective_rpc_errors_reach_the_caller(client):
    with pytest.raises(ValueError, match="unknown RPC method 'nope'"):
        client.collective_rpc("nope")
    with pytest.raises(WorkerError, match="rank 0") as e:
        client.collective_rpc("fail", args=("boom",))
    assert "rank 1" in str(e.value) and "boom on rank 1" in str(e.value)
    with pytest.raises(TypeError, match="cannot be sent to the client as msgpack"):
        client.collective_rpc("make_tensor")
    with pytest.raises(TypeError, match="msgpack-able"):
        client.collective_rpc("echo", args=(object(),))
    with pytest.raises(ValueError, match="module-level function"):
        client.collective_rpc(lambda worker: None)
    with pytest.raises(TimeoutError, match="sleep"):
        client.collective_rpc("sleep", args=(0.5,), timeout=0.1)
    assert client.collective_rpc("echo", args=(1,)) == [[1, "", 0], [1, "", 1]]
    client.add_request(core_request("after", [3], max_tokens=2))
    assert collect(client, {"after"})["after"] == (expected_tokens([3], 2), "length")


def test_get_output_times_out_when_idle(client):
    with pytest.raises(TimeoutError):
        client.get_output(timeout=0.1)


# -- start-up and shut-down -------------------------------------------------------------------
def test_startup_failure_raises_with_the_workers_traceback():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 failed to start") as e:
        SyncMPClient(make_config("FailingLoadWorker"))
    assert time.monotonic() - start < failed_start_limit()
    assert "no weights for rank 1" in str(e.value) and "Traceback" in str(e.value)
    core_pid = int(re.search(r"engine core pid (\d+)", str(e.value)).group(1))
    assert not alive(core_pid)
    wait_no_leftovers(core_pid)


def test_shutdown_is_idempotent_and_leaves_nothing():
    client = SyncMPClient(make_config())
    core_pid, worker_pids = client.core_pid, client.collective_rpc("get_pid")
    waiter_errors = []

    def wait_for_output() -> None:
        try:
            client.get_output()
        except EngineDeadError as e:
            waiter_errors.append(e)

    waiter = threading.Thread(target=wait_for_output)
    waiter.start()
    client.shutdown()
    client.shutdown()
    waiter.join(DEAD_WITHIN_S)
    assert len(waiter_errors) == 1 and "shut down" in str(waiter_errors[0])
    with pytest.raises(EngineDeadError, match="shut down"):
        client.add_request(core_request("late", [1]))
    wait_gone([core_pid, *worker_pids], 1.0)
    wait_no_leftovers(core_pid)


def test_inproc_client_has_the_same_api():
    client = EngineCoreClient.make_client(make_config(), multiprocess=False, asyncio_mode=False)
    assert isinstance(client, InprocClient)
    try:
        client.add_request(core_request("a", [1, 2], max_tokens=3))
        with pytest.raises(ValueError, match="prompt is empty"):
            client.add_request(core_request("b", []))
        assert collect(client, {"a"})["a"] == (expected_tokens([1, 2], 3), "length")
        assert client.collective_rpc("echo", args=(2,), unique_reply_rank=0) == [2, "", 0]
        assert client.reset_prefix_cache() is True
    finally:
        client.shutdown()
    for multiprocess, asyncio_mode in ((False, True), (True, False)):
        with pytest.raises(ValueError, match="choose multiprocess=True with asyncio_mode=True"):
            EngineCoreClient.make_client(make_config(), multiprocess, asyncio_mode)


# -- deaths -----------------------------------------------------------------------------------
def _raises_dead_within(call, limit_s: float = DEAD_WITHIN_S) -> EngineDeadError:
    start = time.monotonic()
    with pytest.raises(EngineDeadError) as e:
        while True:  # outputs produced before the death may come first
            call()
    elapsed = time.monotonic() - start
    assert elapsed < limit_s, f"EngineDeadError after {elapsed:.2f} s"
    return e.value


def _assert_later_calls_fail(client) -> None:
    for call in (
        lambda: client.add_request(core_request("later", [1])),
        lambda: client.abort_requests(["later"]),
        lambda: client.collective_rpc("get_pid"),
        lambda: client.get_output(timeout=scaled(5)),
    ):
        _raises_dead_within(call, limit_s=scaled(0.5))


@pytest.mark.parametrize("busy", ["generating", "in_rpc", "idle"])
def test_worker_sigkill_raises_engine_dead(busy):
    client = SyncMPClient(make_config())
    core_pid, worker_pids = client.core_pid, client.collective_rpc("get_pid")
    try:
        if busy == "generating":
            client.collective_rpc("set_step_delay", args=(0.02,))
            client.add_request(core_request("r", [1, 2], max_tokens=50))
            client.get_output(timeout=scaled(10))
            pending = lambda: client.get_output(timeout=scaled(5))  # noqa: E731
        elif busy == "in_rpc":
            pending = lambda: client.collective_rpc("sleep", args=(3.0,))  # noqa: E731
            threading.Timer(0.3, os.kill, args=(worker_pids[1], signal.SIGKILL)).start()
        else:
            pending = lambda: client.get_output(timeout=scaled(5))  # noqa: E731
        if busy != "in_rpc":
            os.kill(worker_pids[1], signal.SIGKILL)
        error = _raises_dead_within(pending, DEAD_WITHIN_S + (0.3 if busy == "in_rpc" else 0))
        assert "worker rank 1 died" in str(error) and "SIGKILL" in str(error)
        _assert_later_calls_fail(client)
        wait_gone([core_pid, *worker_pids], 10.0)  # the core exits on its own
    finally:
        client.shutdown()
    wait_no_leftovers(core_pid)


def test_core_sigkill_raises_engine_dead_and_workers_exit():
    client = SyncMPClient(make_config())
    core_pid, worker_pids = client.core_pid, client.collective_rpc("get_pid")
    try:
        client.collective_rpc("set_step_delay", args=(0.02,))
        client.add_request(core_request("r", [1, 2], max_tokens=50))
        client.get_output(timeout=scaled(10))
        os.kill(core_pid, signal.SIGKILL)
        error = _raises_dead_within(lambda: client.get_output(timeout=scaled(5)))
        assert f"engine core process (pid {core_pid}) died" in str(error)
        assert "SIGKILL" in str(error)
        assert wait_gone(worker_pids, 5.0) < scaled(2.0)
        _assert_later_calls_fail(client)
    finally:
        client.shutdown()
    wait_no_leftovers(core_pid)


def test_async_client_add_get_abort_and_core_death():
    async def main() -> None:
        client = EngineCoreClient.make_client(make_config(), multiprocess=True, asyncio_mode=True)
        assert isinstance(client, AsyncMPClient)
        try:
            await _exercise_async_client(client)
            worker_pids = await client.collective_rpc("get_pid")
            os.kill(client.core_pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                await client.get_output(timeout=scaled(5))
            assert time.monotonic() - start < DEAD_WITHIN_S
            with pytest.raises(EngineDeadError):
                await client.collective_rpc("get_pid")
            assert wait_gone(worker_pids, 5.0) < scaled(2.0)
        finally:
            client.shutdown()
        wait_no_leftovers(client.core_pid)

    asyncio.run(main())


async def _exercise_async_client(client: AsyncMPClient) -> None:
    async def collect_async(request_ids: set[str]) -> dict:
        results: dict[str, tuple[list[int], str | None]] = {}
        while not all(results.get(r, ([], None))[1] for r in request_ids):
            for out in (await client.get_output(timeout=scaled(10))).outputs:
                tokens = results.get(out.request_id, ([], None))[0] + out.new_token_ids
                results[out.request_id] = (tokens, out.finish_reason and str(out.finish_reason))
        return results

    await client.add_request(core_request("a", [5], max_tokens=4))
    assert (await collect_async({"a"}))["a"] == (expected_tokens([5], 4), "length")
    with pytest.raises(ValueError, match="prompt is empty"):
        await client.add_request(core_request("empty", []))
    await client.collective_rpc("set_step_delay", args=(0.01,))
    await client.add_request(core_request("long", [1], max_tokens=50))
    await client.get_output(timeout=scaled(10))
    await client.abort_requests(["long"])
    await client.add_request(core_request("short", [8], max_tokens=2))
    results = await collect_async({"short"})
    assert results["short"] == (expected_tokens([8], 2), "length")
    assert results.get("long", ([], None))[1] is None
    assert await client.collective_rpc(rank_times, args=(2,)) == [0, 2]
    assert await client.reset_prefix_cache() is True


# -- the client's death -----------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sigkill", "exit"])
def test_core_exits_with_its_client(mode):
    """SIGKILL of the client mid-generation, or its exit without shutdown(): the core and its
    workers exit and remove everything, the client's ipc directory included."""
    proc, info = start_json_script(
        "tests.engine.client_script", "wait" if mode == "sigkill" else "exit"
    )
    if mode == "sigkill":
        proc.kill()
    assert proc.wait(timeout=scaled(30)) == (-signal.SIGKILL if mode == "sigkill" else 0)
    elapsed = wait_gone([info["core_pid"], *info["worker_pids"]], 10.0)
    if mode == "sigkill":
        assert elapsed < scaled(3.0), f"the engine took {elapsed:.2f} s to exit"
    wait_no_leftovers(info["core_pid"])
    assert not os.path.exists(info["ipc_dir"])


# -- a real model -----------------------------------------------------------------------------
@pytest.mark.slow
def test_real_checkpoint_generates_transformers_greedy_tokens(tmp_path):
    torch = pytest.importorskip("torch")
    from tests.model.checkpoints import load_hf_model, make_checkpoint
    from v1engine.engine_args import EngineArgs

    path = make_checkpoint(tmp_path, "llama")
    config = EngineArgs(
        model=path,
        tensor_parallel_size=2,
        device="cpu",
        dtype="float32",
        max_model_len=64,
        block_size=4,
        kv_cache_memory_bytes=4 << 20,
    ).create_engine_config()
    prompts = {"a": [1, 5, 9, 13], "b": [3, 100, 7]}
    with SyncMPClient(config) as client:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            client.add_request(core_request("bad", [1, 131]))
        for request_id, prompt in prompts.items():
            params = SamplingParams(max_tokens=6, temperature=0.0)
            client.add_request(EngineCoreRequest(request_id, prompt, params))
        results = collect(client, set(prompts), timeout_s=60)
    hf_model = load_hf_model(path)
    for request_id, prompt in prompts.items():
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                logits = hf_model(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(logits.argmax()))
        assert results[request_id] == (tokens[len(prompt) :], "length"), request_id
