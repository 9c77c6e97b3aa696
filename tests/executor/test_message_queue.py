"""MessageQueue with real spawned reader processes and real shared memory."""

from __future__ import annotations

import multiprocessing
import os
import stat
import threading
import time

import numpy as np
import psutil
import pytest
import torch

from tests.timeouts import scaled
from v1engine.executor.message_queue import MessageQueue, QueueClosedError

SMALL_CHUNK = 64 * 1024  # so the ZeroMQ overflow path is exercised with small payloads


def _messages() -> list:
    return [
        "hello",
        {"ids": list(range(100)), "nested": ("a", 1.5, None)},
        np.arange(1000, dtype=np.int32),
        torch.randn(4, 8, dtype=torch.bfloat16),
        torch.arange(200_000, dtype=torch.float32),  # 800 KB: over SMALL_CHUNK -> ZeroMQ
        torch.empty(0, 3),
        b"x" * 10,
        np.ones((300, 300)),  # 720 KB: ZeroMQ again, order must still hold
        "last",
    ]


def _portable(value):
    # mp.Queue would share tensors through file descriptors owned by the reader; send bytes.
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            str(value.dtype),
            tuple(value.shape),
            value.view(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"",
        )
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    return value


def _reader_main(handle, rank: int, results) -> None:
    mq = MessageQueue.create_from_handle(handle, rank)
    try:
        mq.wait_until_ready(timeout=scaled(30))
        received = [_portable(mq.dequeue(timeout=scaled(30))) for _ in range(len(_messages()))]
        results.put((rank, received))
    except Exception as e:
        results.put((rank, repr(e)))
    finally:
        mq.close()


# Readers >= n_local_reader take the TCP path, as a reader on another node would.
@pytest.mark.parametrize("n_local_reader", [2, 1, 0], ids=["shm", "shm+tcp", "tcp"])
def test_broadcast_to_reader_processes_keeps_order_and_contents(n_local_reader):
    ctx = multiprocessing.get_context("spawn")
    writer = MessageQueue(
        2, max_chunk_bytes=SMALL_CHUNK, n_local_reader=n_local_reader, remote_host="127.0.0.1"
    )
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_reader_main, args=(writer.export_handle(), r, results))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        writer.wait_until_ready(timeout=scaled(30))
        sent = _messages()
        for message in sent:
            writer.enqueue(message, timeout=30)
        got = dict(results.get(timeout=60) for _ in procs)
        results.close()
        results.join_thread()
    finally:
        for p in procs:
            p.join(10)
        writer.close()
    for rank in range(2):
        assert got[rank] == [_portable(m) for m in sent], rank


def pass_ready_barrier(writer: MessageQueue, readers: list[MessageQueue]) -> None:
    """Both sides of wait_until_ready in one process: once it returned, every reader's ZeroMQ
    subscription is in, so no overflow message can be published before it (and lost)."""
    thread = threading.Thread(target=writer.wait_until_ready, args=(scaled(30),))
    thread.start()
    for reader in readers:
        reader.wait_until_ready(timeout=scaled(30))
    thread.join()


def local_pair(n_reader: int = 1, **kwargs) -> tuple[MessageQueue, list[MessageQueue]]:
    """A writer and its readers on this node, past the ready barrier."""
    writer = MessageQueue(n_reader, **kwargs)
    readers = [MessageQueue.create_from_handle(writer.export_handle(), r) for r in range(n_reader)]
    pass_ready_barrier(writer, readers)
    return writer, readers


def _close(writer: MessageQueue, readers: list[MessageQueue]) -> None:
    for r in readers:
        r.close()
    writer.close()


def remote_pair() -> tuple[MessageQueue, MessageQueue]:
    """A writer whose one reader takes the TCP path; both pass the ready barrier."""
    writer = MessageQueue(1, n_local_reader=0, remote_host="127.0.0.1")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    pass_ready_barrier(writer, [reader])
    return writer, reader


def test_tcp_reader_timeout_close_and_writer_close():
    writer, reader = remote_pair()
    assert writer.export_handle().ring_path == ""  # no reader on this node: no shared memory
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.2)
    writer.enqueue(torch.arange(10))
    writer.close()
    assert torch.equal(reader.dequeue(timeout=scaled(5)), torch.arange(10))
    with pytest.raises(QueueClosedError):
        reader.dequeue(timeout=scaled(5))
    reader.close()

    writer, reader = remote_pair()
    thread = threading.Thread(target=lambda: pytest.raises(QueueClosedError, reader.dequeue))
    thread.start()
    time.sleep(0.2)
    reader.close()
    thread.join(2)
    assert not thread.is_alive()
    writer.close()


def test_received_tensor_does_not_alias_ring_memory():
    writer, (reader,) = local_pair(max_chunks=2)
    try:
        writer.enqueue(torch.zeros(1000))
        first = reader.dequeue()
        # Reuse every chunk of the ring with different data; `first` must not change.
        for i in range(6):
            writer.enqueue(torch.full((1000,), float(i + 1)))
            assert reader.dequeue()[0] == i + 1
        assert torch.equal(first, torch.zeros(1000))
        first.add_(1)  # and it is an ordinary writable tensor
    finally:
        _close(writer, [reader])


def test_message_larger_than_a_chunk_goes_over_zeromq():
    writer, (reader,) = local_pair(max_chunk_bytes=SMALL_CHUNK)
    try:
        big = np.random.default_rng(0).integers(0, 255, size=5 * SMALL_CHUNK, dtype=np.uint8)
        writer.enqueue(big)  # could not fit in any ring chunk
        writer.enqueue("after")
        assert np.array_equal(reader.dequeue(timeout=scaled(10)), big)
        assert reader.dequeue(timeout=scaled(10)) == "after"
    finally:
        _close(writer, [reader])


def test_dequeue_timeout_raises():
    writer, (reader,) = local_pair()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=0.2)
        assert time.monotonic() - start < scaled(5)
        writer.enqueue("still works")
        assert reader.dequeue(timeout=scaled(5)) == "still works"
    finally:
        _close(writer, [reader])


def test_full_ring_blocks_writer_until_timeout():
    writer, (reader,) = local_pair(max_chunks=2)
    try:
        writer.enqueue(1)
        writer.enqueue(2)
        with pytest.raises(TimeoutError):
            writer.enqueue(3, timeout=0.2)
        assert reader.dequeue() == 1
        writer.enqueue(3, timeout=5)
        assert [reader.dequeue(), reader.dequeue()] == [2, 3]
    finally:
        _close(writer, [reader])


def test_close_wakes_a_blocked_reader():
    writer, (reader,) = local_pair()
    errors = []

    def blocked() -> None:
        try:
            reader.dequeue()
        except QueueClosedError as e:
            errors.append(e)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.2)
    reader.close()
    thread.join(5)
    assert not thread.is_alive() and len(errors) == 1
    writer.close()


def test_writer_close_makes_readers_raise_after_draining():
    writer, (reader,) = local_pair()
    writer.enqueue("pending")
    writer.close()
    assert reader.dequeue(timeout=scaled(5)) == "pending"
    with pytest.raises(QueueClosedError):
        reader.dequeue(timeout=scaled(5))
    reader.close()


def test_resources_are_private_and_removed_on_close():
    writer, (reader,) = local_pair()
    handle = writer.export_handle()
    socket_path = handle.zmq_address.removeprefix("ipc://")
    assert stat.S_IMODE(os.stat(handle.ipc_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(handle.ring_path).st_mode) == 0o600
    assert os.path.exists(socket_path)
    _close(writer, [reader])
    assert not os.path.exists(handle.ring_path)
    assert not os.path.exists(socket_path)
    assert not os.path.exists(handle.ipc_dir)


def test_reader_rank_is_validated():
    writer = MessageQueue(2)
    try:
        with pytest.raises(ValueError, match="reader rank"):
            MessageQueue.create_from_handle(writer.export_handle(), 2)
    finally:
        writer.close()


def _idle_reader_main(handle, ready) -> None:
    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready(timeout=scaled(30))
    ready.set()
    while mq.dequeue() != "stop":
        pass
    mq.close()


def test_idle_reader_sleeps_instead_of_spinning():
    ctx = multiprocessing.get_context("spawn")
    writer = MessageQueue(1)
    ready = ctx.Event()
    proc = ctx.Process(target=_idle_reader_main, args=(writer.export_handle(), ready))
    proc.start()
    try:
        writer.wait_until_ready(timeout=scaled(30))
        assert ready.wait(30)
        writer.enqueue("tick")
        time.sleep(0.1)
        reader = psutil.Process(proc.pid)
        before = reader.cpu_times()
        time.sleep(0.5)
        after = reader.cpu_times()
        busy_s = (after.user + after.system) - (before.user + before.system)
        # A spinning reader would burn ~0.5 s here; a sleeping one close to nothing.
        assert busy_s < 0.05, f"idle reader used {busy_s:.3f} s of CPU in 0.5 s"
        writer.enqueue("stop")
    finally:
        proc.join(10)
        writer.close()
