"""process.py: spawn with the READY/FAILED handshake, stop with escalation, follow the parent.

The children are tiny functions of this module (the spawn context imports it by name).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.process_utils import alive, wait_gone
from tests.timeouts import scaled
from v1engine import process
from v1engine.process import (
    ChildProcess,
    ChildStartupError,
    get_distributed_init_method,
    get_open_port,
    install_sigterm_handler,
    report_startup,
    stop_children,
    wait_until_ready,
    watch_parent,
)


# -- children ------------------------------------------------------------------------------------
def _ready_child(value: int, ready_conn) -> None:
    report_startup(ready_conn, lambda: value, lambda built: built * 2)
    time.sleep(60)  # until stopped


def _bad_config() -> None:
    raise ValueError("bad config in the child")


def _failing_child(ready_conn) -> None:
    report_startup(ready_conn, _bad_config)


def _peer_effect() -> None:
    raise RuntimeError("connection closed by peer")


def _late_cause() -> None:
    time.sleep(0.5)
    raise RuntimeError("no weights here")


def _failing_with(build, ready_conn) -> None:
    report_startup(ready_conn, build)


def _dying_child(ready_conn) -> None:
    os._exit(3)


def _silent_child(ready_conn) -> None:
    time.sleep(60)


def _sigterm_child(path: str, deaf: bool, ready_conn) -> None:
    if deaf:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        install_sigterm_handler()
    try:  # entered before READY, so a SIGTERM right after it still runs the clean-up
        report_startup(ready_conn, lambda: None)
        time.sleep(60)
    finally:
        with open(path, "w") as f:
            f.write("clean-up ran")


def _env_child(names: list[str], ready_conn) -> None:
    values = [os.environ.get(name) for name in names]
    report_startup(ready_conn, lambda: values, lambda built: built)


def _orphan(path: str, hang: bool, ready_conn) -> None:
    def on_parent_death() -> None:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        if hang:
            time.sleep(60)

    watch_parent(on_parent_death, exit_after_s=1.0)
    report_startup(ready_conn, lambda: None)
    time.sleep(60)


def _parent_of_orphan(path: str, hang: bool, ready_conn) -> None:
    child = ChildProcess(_orphan, (path, hang), name="orphan", label="the orphan", daemon=False)
    child.wait_until_ready(60)
    report_startup(ready_conn, lambda: child.pid, lambda pid: pid)
    time.sleep(60)  # until SIGKILLed


def _spawn(target, args: tuple = (), label: str = "the child") -> ChildProcess:
    return ChildProcess(target, args, name="v1engine-test-child", label=label, daemon=True)


# -- tests -------------------------------------------------------------------------------------
def test_ready_payloads_come_back_in_order():
    children = [_spawn(_ready_child, (i,), f"child {i}") for i in range(2)]
    try:
        assert wait_until_ready(children, 60) == [0, 2]
    finally:
        stop_children(children)
    assert all(not alive(c.pid) for c in children)


def test_env_defaults_reach_the_child_unless_set_and_leave_this_process_alone(monkeypatch):
    monkeypatch.setenv("V1ENGINE_TEST_SET", "mine")
    monkeypatch.delenv("V1ENGINE_TEST_UNSET", raising=False)
    names = ["V1ENGINE_TEST_SET", "V1ENGINE_TEST_UNSET"]
    defaults = {"V1ENGINE_TEST_SET": "default", "V1ENGINE_TEST_UNSET": "default"}
    child = ChildProcess(
        _env_child,
        (names,),
        name="env-child",
        label="the child",
        daemon=True,
        env_defaults=defaults,
    )
    try:
        assert child.wait_until_ready(scaled(60)) == ["mine", "default"]
    finally:
        child.stop()
    assert os.environ["V1ENGINE_TEST_SET"] == "mine"
    assert "V1ENGINE_TEST_UNSET" not in os.environ


def test_failed_child_carries_its_exception_type_and_traceback():
    child = _spawn(_failing_child, label="child 7")
    with pytest.raises(ChildStartupError) as info:
        child.wait_until_ready(60)
    child.stop()
    assert info.value.exc_type == "ValueError" and info.value.label == "child 7"
    text = str(info.value)
    assert text.startswith("child 7 failed to start:") and "Traceback" in text
    assert "ValueError: bad config in the child" in text and "_bad_config" in text


def test_dead_child_is_named_with_its_exit_code_and_the_wait_ends_at_once():
    silent = _spawn(_silent_child, label="silent child")
    dying = _spawn(_dying_child, label="dying child")
    start = time.monotonic()
    try:
        with pytest.raises(
            ChildStartupError, match=r"dying child died during start-up \(exit code 3\)"
        ):
            wait_until_ready([silent, dying], 60)
        assert time.monotonic() - start < scaled(30)
    finally:
        stop_children([silent, dying])


def test_the_failures_of_several_children_come_together(monkeypatch):
    """A child's failure may be the effect of another's (its peer died): the failures the others
    report soon after come along, so the cause is in the message whichever came first. (A
    child that stays silent holds the wait up only that long: the dead-child test above.)"""
    monkeypatch.setattr(process, "_OTHER_FAILURES_S", scaled(20))
    children = [
        _spawn(_failing_with, (_peer_effect,), "rank 0"),
        _spawn(_failing_with, (_late_cause,), "rank 1"),
    ]
    try:
        with pytest.raises(ChildStartupError) as info:
            wait_until_ready(children, 600)
    finally:
        stop_children(children)
    text = str(info.value)
    assert text.startswith(f"{info.value.label} failed to start:")
    assert "rank 0 failed to start:" in text and "connection closed by peer" in text
    assert "rank 1 failed to start:" in text and "no weights here" in text


def test_silent_child_times_out_naming_it():
    child = _spawn(_silent_child, label="silent child")
    try:
        with pytest.raises(ChildStartupError, match="silent child did not start within 1 s"):
            child.wait_until_ready(1.0)
    finally:
        child.stop()
    assert child.exitcode is None or not alive(child.pid)


def test_stopping_an_exited_child_asks_nobody_and_is_idempotent():
    child = _spawn(_ready_child, (1,))
    child.wait_until_ready(60)
    asked = []
    os.kill(child.pid, signal.SIGKILL)  # "obeys" the request at once
    child.proc.join(10)
    child.stop(lambda: asked.append(True) or True)
    assert asked == []  # nobody left to ask
    child.stop()


def test_sigterm_runs_clean_up_and_a_deaf_child_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(process, "TERMINATE_STOP_S", 1.0)
    polite = _spawn(_sigterm_child, (str(tmp_path / "polite"), False))
    deaf = _spawn(_sigterm_child, (str(tmp_path / "deaf"), True))
    wait_until_ready([polite, deaf], 60)
    pids = [polite.pid, deaf.pid]
    start = time.monotonic()
    stop_children([polite, deaf], ask_to_stop=lambda: False)  # cannot hear: SIGTERM at once
    assert time.monotonic() - start < scaled(10)
    assert (tmp_path / "polite").read_text() == "clean-up ran"
    assert not (tmp_path / "deaf").exists()  # SIGKILL: no clean-up
    assert not any(alive(pid) for pid in pids)


@pytest.mark.parametrize("hang", [False, True])
def test_orphan_cleans_up_and_exits_when_its_parent_is_killed(tmp_path, hang):
    path = tmp_path / "orphan"
    # Not a daemon: daemonic processes may not start children.
    parent = ChildProcess(
        _parent_of_orphan, (str(path), hang), name="parent", label="the parent", daemon=False
    )
    orphan_pid = parent.wait_until_ready(60)
    os.kill(parent.pid, signal.SIGKILL)
    parent.stop()
    # exit_after_s=1.0 bounds even a clean-up that hangs.
    assert wait_gone([orphan_pid], limit_s=10) < scaled(5)
    assert path.read_text() == str(orphan_pid)


def test_free_port_and_init_method():
    port = get_open_port()
    assert 0 < port < 65536
    assert get_distributed_init_method(port=port) == f"tcp://127.0.0.1:{port}"
    assert get_distributed_init_method("10.0.0.1", 1234) == "tcp://10.0.0.1:1234"
