"""Every wait of a MessageQueue keeps to its timeout. Issue 15 saw `dequeue(timeout=10)` wait
300 s when an overflow message was lost (published before the reader subscribed): on the ring,
on the ZeroMQ overflow path and on the TCP leg, `dequeue(timeout=t)` raises TimeoutError within
t + 0.5 s, and `timeout=0` still takes a message that is already there.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.executor.test_message_queue import SMALL_CHUNK, local_pair, remote_pair
from tests.timeouts import scaled
from v1engine.executor.message_queue import MessageQueue

TIMEOUT_S = 0.5
SLACK_S = scaled(0.5)


def assert_times_out(reader: MessageQueue, match: str = "timed out") -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=match):
        reader.dequeue(timeout=TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + scaled(SLACK_S), elapsed


def _ring():
    writer, (reader,) = local_pair()
    return writer, reader


@pytest.mark.parametrize("make_pair", [_ring, remote_pair], ids=["ring", "tcp"])
def test_empty_queue_times_out_on_time_and_timeout_0_takes_what_is_there(make_pair):
    writer, reader = make_pair()
    try:
        assert_times_out(reader)
        writer.enqueue("here")
        deadline = time.monotonic() + scaled(10)
        while True:  # the TCP leg delivers asynchronously: poll with timeout=0
            try:
                assert reader.dequeue(timeout=0) == "here"
                break
            except TimeoutError:
                assert time.monotonic() < deadline
    finally:
        reader.close()
        writer.close()


def test_lost_overflow_message_times_out_on_time_and_is_never_replaced():
    writer = MessageQueue(1, max_chunk_bytes=SMALL_CHUNK)
    # Published with no reader subscribed yet (no ready barrier): ZeroMQ drops the frames,
    # while the ring keeps the marker that says they are coming.
    writer.enqueue(np.zeros(4 * SMALL_CHUNK, dtype=np.uint8))
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        assert_times_out(reader, match="wait_until_ready")
        writer.enqueue("after")
        # Still waiting for the lost message: a later one never takes its place.
        assert_times_out(reader, match="wait_until_ready")
    finally:
        reader.close()
        writer.close()


def test_lost_tcp_message_times_out_on_time():
    writer = MessageQueue(1, n_local_reader=0, remote_host="127.0.0.1")
    writer.enqueue("before anyone listened")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        assert_times_out(reader)
    finally:
        reader.close()
        writer.close()
