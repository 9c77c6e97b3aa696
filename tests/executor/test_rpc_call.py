"""RpcCall: one rule for what a worker can be asked to run, one wire form (no processes)."""

from __future__ import annotations

import functools
import pickle

import msgspec
import pytest

from tests.executor.rpc_worker import RPCTestWorker, rank_times
from v1engine.executor.rpc_call import RpcCall, WorkerMethods

WORKER = RPCTestWorker(config=None, local_rank=1, rank=1, distributed_init_method="")


def test_a_public_method_name_is_checked_against_the_worker_class():
    methods = WorkerMethods.of(RPCTestWorker)
    assert "echo" in methods.names and "rank" not in methods.names  # an attribute, not a method
    RpcCall("echo", (1,)).check(methods, world_size=2)
    for name in ("no_such_method", "_private_helper", "rank"):
        with pytest.raises(ValueError, match=f"unknown RPC method '{name}'.*RPCTestWorker.*echo"):
            RpcCall(name).check(methods, world_size=2)
    with pytest.raises(ValueError, match=r"unique_reply_rank must be in \[0, 2\)"):
        RpcCall("echo", unique_reply_rank=2).check(methods, world_size=2)


@pytest.mark.parametrize("function", [rank_times, RPCTestWorker.get_rank])
def test_module_level_functions_and_class_methods_run_with_the_worker(function):
    call = RpcCall(function, (10,) if function is rank_times else ())
    call.check(WorkerMethods.of(RPCTestWorker), world_size=2)
    assert call.run_on(WORKER) == (10 if function is rank_times else 1)


def _local_function():
    def nested(worker):
        return worker.rank

    return nested


@pytest.mark.parametrize(
    "function, reason",
    [
        (lambda worker: 1, "is a lambda or is defined inside a function"),
        (_local_function(), "is a lambda or is defined inside a function"),
        (WORKER.get_rank, "does not lead back to it"),
        (functools.partial(rank_times, factor=2), "has no module and qualified name"),
    ],
)
def test_functions_the_workers_cannot_import_are_refused_with_what_to_pass(function, reason):
    with pytest.raises(ValueError, match="module-level function") as info:
        RpcCall(function)
    assert reason in str(info.value) and "Class.method" in str(info.value)


def test_argument_types_are_checked():
    assert RpcCall("echo", [1, 2], None).args == (1, 2)
    assert RpcCall("echo").kwargs == {}
    with pytest.raises(TypeError, match="args must be a tuple"):
        RpcCall("echo", "abc")
    with pytest.raises(TypeError, match="kwargs must be a dict with str keys"):
        RpcCall("echo", (), {1: 2})
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        RpcCall("echo", timeout=-1)
    with pytest.raises(TypeError, match="unique_reply_rank must be an int"):
        RpcCall("echo", unique_reply_rank="0")


@pytest.mark.parametrize(
    "call",
    [
        RpcCall("echo", ("x",), {"value": 1}, 2.5, 0),
        RpcCall(rank_times, (3,)),
        RpcCall(RPCTestWorker.echo, (["a", 1],)),
    ],
)
def test_wire_form_survives_msgpack_and_names_functions_by_path(call):
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(call.to_wire()))
    assert RpcCall.from_wire(wire) == call
    if not isinstance(call.method, str):
        assert wire["method"] == f"tests.executor.rpc_worker:{call.method.__qualname__}"


def test_from_wire_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="needs a str 'method'"):
        RpcCall.from_wire({"method": 3})
    with pytest.raises(ValueError, match="cannot be imported in this process"):
        RpcCall.from_wire({"method": "no_such_module:fn", "is_function": True})
    with pytest.raises(ValueError, match="cannot be imported in this process"):
        RpcCall.from_wire({"method": "tests.executor.rpc_worker:nope", "is_function": True})


def test_pickled_call_is_equal_and_keeps_the_function_by_reference():
    call = RpcCall(rank_times, (3,), {}, None, 1)
    copy = pickle.loads(pickle.dumps(call, protocol=5))
    assert copy == call and copy.method is rank_times
    assert copy.name == "tests.executor.rpc_worker.rank_times"
