"""Child-process lifetime, one way for both boundaries: the client starts the engine core, the
engine core starts its workers.

Parent side: `ChildProcess(target, args, name=..., label=..., daemon=...)` spawns
`target(*args, ready_conn)`; `wait_until_ready(children, timeout_s)` returns each child's READY
payload, or raises `ChildStartupError` naming the first child that failed (with its traceback),
died (with its exit code or signal) or stayed silent; `stop_children(children, ask_to_stop)`
asks, then sends SIGTERM, then SIGKILL; `child.terminate()` only sends SIGTERM, for a child stuck
where no message reaches it (stop_children reaps it later). Child side:
`report_startup(ready_conn, build, payload)` runs the child's start-up and answers READY or
FAILED; `watch_parent(on_parent_death)` ends the child when its parent dies, even by SIGKILL;
`install_sigterm_handler()` turns SIGTERM into SystemExit so clean-up code runs.

The start-up pipe is one-way, child -> parent, and carries exactly one pickled message:
    (READY, payload)                    the child is built; the payload is the caller's (a
                                        worker: its reply queue's handle; the engine core:
                                        what the client needs to know about the engine)
    (FAILED, exc_type_name, traceback)  building raised; the child then exits 1
End of file without a message means the child died; its exit code says how. Pickle is safe here:
only the parent and the child it spawned hold the pipe.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from v1engine.logger import init_logger

logger = init_logger(__name__)

T = TypeVar("T")

READY = "READY"
FAILED = "FAILED"

# -- the timeouts (seconds) of every child process, engine core and workers alike -----------------
# Loading a large model's weights can take minutes. A failure ends the wait at once (FAILED or
# the child's death), so this only bounds a child that hangs.
WORKER_STARTUP_TIMEOUT_S = 600.0
# The engine core's start-up contains its workers' (above), then memory profiling and warm-up.
ENGINE_CORE_STARTUP_TIMEOUT_S = 900.0
# After READY both ends pass their queues' ready barriers; the peer is alive and past loading,
# so waiting a minute means it is stuck.
HANDSHAKE_TIMEOUT_S = 60.0
# A child asked to stop first finishes its current call, then releases what it holds (a worker
# its device memory and process group; the engine core its workers, each asked in turn).
GRACEFUL_STOP_S = 5.0
# On SIGTERM the engine core's clean-up gives its own workers GRACEFUL_STOP_S to stop; the margin
# covers the rest of its shut-down. A child still alive after this is killed.
TERMINATE_STOP_S = GRACEFUL_STOP_S + 2.0
# An orphan must not linger: after its parent died a child exits by then even if its clean-up
# hangs. Cutting that clean-up short leaks nothing: the child's own children watch it in turn.
PARENT_DEATH_EXIT_S = 5.0
# A child whose sentinel fired has exited or is exiting; joining it makes its exit code known.
_REAP_S = 1.0
# After a child's failure, how long the others may take to report theirs: the first report may
# name only the effect of another's failure ("connection closed by peer"), not its cause.
_OTHER_FAILURES_S = 2.0


class ChildStartupError(RuntimeError):
    """A child did not report READY.

    Attributes:
        label: the child, as errors name it ("worker rank 1").
        exc_type: the name of the exception the child raised (FAILED), or None when it died or
            stayed silent. A parent may re-raise some types as themselves (e.g. ValueError for
            a bad configuration).
    """

    def __init__(self, message: str, label: str, exc_type: str | None = None) -> None:
        super().__init__(message)
        self.label = label
        self.exc_type = exc_type

    def for_caller(self) -> Exception:
        """This failure as the parent raises it: a bad configuration (a ValueError in the child)
        stays a ValueError, as if the child's code had run in the parent; anything else is a
        RuntimeError. The message, with the child's traceback, is the same."""
        return (ValueError if self.exc_type == "ValueError" else RuntimeError)(str(self))


def describe_exitcode(exitcode: int | None) -> str:
    """An exit code in words: "exit code 3", "exit code -9, killed by SIGKILL"."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"exit code {exitcode}, killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"exit code {exitcode}"
    return f"exit code {exitcode}"


# -- parent side ---------------------------------------------------------------------------------
class ChildProcess:
    """A spawned child process and the parent's end of its start-up pipe.

    Args:
        target: the child's entry point, run as `target(*args, ready_conn)`; it must answer
            once on `ready_conn`, best through `report_startup`.
        args: picklable arguments (the spawn context pickles them).
        name: the process's name (ps, logs), e.g. "V1EngineWorker-1".
        label: how errors name the child, e.g. "worker rank 1", "the engine core".
        daemon: True lets multiprocessing end the child when the parent exits normally; a
            child that starts children of its own (the engine core) must not be a daemon.
        env_defaults: environment variables the child starts with unless this process's
            environment sets them (a user's own setting wins). They must be in place before
            the child's first import, which may be the parent's `__main__`, so they are set
            around the spawn and restored at once; this process's environment is unchanged.

    Raises:
        whatever `Process.start()` raises (e.g. unpicklable args); nothing is left running.
    """

    def __init__(
        self,
        target: Callable[..., None],
        args: tuple,
        *,
        name: str,
        label: str,
        daemon: bool,
        env_defaults: dict[str, str] | None = None,
    ) -> None:
        self.label = label
        self._closed = False
        context = multiprocessing.get_context("spawn")
        self._ready_conn, writer = context.Pipe(duplex=False)
        self.proc = context.Process(target=target, args=(*args, writer), name=name, daemon=daemon)
        try:
            with _environment_defaults(env_defaults or {}):
                self.proc.start()
        except BaseException:
            self._ready_conn.close()
            raise
        finally:
            writer.close()  # the child has its copy; EOF then means the child is gone
        self.pid: int = self.proc.pid
        self._exitcode: int | None = None  # kept once the process handle is closed

    @property
    def sentinel(self) -> int:
        """Becomes ready when the process ends (for `multiprocessing.connection.wait`)."""
        return self.proc.sentinel

    @property
    def exitcode(self) -> int | None:
        return self._exitcode if self._closed else self.proc.exitcode

    def exit_reason(self) -> str:
        """How the process ended, e.g. "exit code -9, killed by SIGKILL"; call once its
        sentinel fired."""
        if not self._closed:
            self.proc.join(_REAP_S)
        return describe_exitcode(self.exitcode)

    def wait_until_ready(self, timeout_s: float) -> Any:
        """This child's READY payload; see the module function."""
        return wait_until_ready([self], timeout_s)[0]

    def terminate(self) -> None:
        """Sends SIGTERM and returns at once, for a child that may be stuck where no message
        reaches it; `stop_children` later reaps it (SIGKILL if it ignored this)."""
        if not self._closed and self.proc.exitcode is None:
            self.proc.terminate()

    def stop(self, ask_to_stop: Callable[[], bool] | None = None) -> None:
        """Ends the process; see `stop_children`."""
        stop_children([self], ask_to_stop)

    def _close(self) -> None:
        if not self._closed:
            self._exitcode = self.proc.exitcode
            self._closed = True
            self._ready_conn.close()
            self.proc.close()


@contextlib.contextmanager
def _environment_defaults(defaults: dict[str, str]) -> Iterator[None]:
    # A spawned child inherits os.environ as it is when it starts.
    added = [name for name in defaults if name not in os.environ]
    with _ENVIRON_LOCK:
        for name in added:
            os.environ[name] = defaults[name]
        try:
            yield
        finally:
            for name in added:
                os.environ.pop(name, None)


_ENVIRON_LOCK = threading.Lock()


def wait_until_ready(children: Sequence[ChildProcess], timeout_s: float) -> list[Any]:
    """Waits for every child's READY, watching the pipes and the process sentinels together.

    Returns:
        The READY payloads, in the order of `children`.

    Raises:
        ChildStartupError: the first child that reported FAILED (the message carries its
            traceback), died (its exit code) or did not answer within `timeout_s`, and the
            others' failures in _OTHER_FAILURES_S after it. The caller stops the children.
    """
    reports: dict[int, Any] = {}  # READY payloads (or the failures, also in `failures`)
    failures: list[ChildStartupError] = []
    index_of = {c._ready_conn: i for i, c in enumerate(children)}
    index_of.update({c.sentinel: i for i, c in enumerate(children)})
    deadline = time.monotonic() + timeout_s
    while len(reports) < len(children):
        waiting = [i for i in range(len(children)) if i not in reports]
        objects = [c._ready_conn for c in children] + [c.sentinel for c in children]
        ready = wait([o for o in objects if index_of[o] in waiting], deadline - time.monotonic())
        if not ready and not failures:
            silent = ", ".join(children[i].label for i in waiting)
            raise ChildStartupError(
                f"{silent} did not start within {timeout_s:.0f} s", children[waiting[0]].label
            )
        if not ready:
            break
        # A pipe first: a child that reported and then exited must be read, not called dead.
        for obj in sorted(ready, key=lambda o: not isinstance(o, Connection)):
            i = index_of[obj]
            if i not in reports:
                try:
                    reports[i] = _read_report(children[i])
                except ChildStartupError as e:
                    reports[i] = e
                    if not failures:  # the others get a moment to report theirs
                        deadline = min(deadline, time.monotonic() + _OTHER_FAILURES_S)
                    failures.append(e)
    if failures:
        text = "\n\n".join(map(str, failures))
        raise ChildStartupError(text, failures[0].label, failures[0].exc_type)
    for child in children:
        child._ready_conn.close()
    return [reports[i] for i in range(len(children))]


def _read_report(child: ChildProcess) -> Any:
    """The payload of the child's READY; raises ChildStartupError for anything else."""
    try:
        message = child._ready_conn.recv() if child._ready_conn.poll() else None
    except EOFError:
        message = None  # exited without a word: its exit code says how
    if message is not None and message[0] == READY:
        return message[1]
    if message is not None:
        _, exc_type, text = message
        child.proc.join(GRACEFUL_STOP_S)  # it exits after FAILED, once it released what it held
        raise ChildStartupError(f"{child.label} failed to start:\n{text}", child.label, exc_type)
    raise ChildStartupError(
        f"{child.label} died during start-up ({child.exit_reason()}); see its log above",
        child.label,
    )


def stop_children(
    children: Sequence[ChildProcess], ask_to_stop: Callable[[], bool] | None = None
) -> None:
    """Ends every child and releases its handle; idempotent.

    First `ask_to_stop()` (e.g. send SHUTDOWN), which returns False when the children cannot hear
    it (still starting, or the channel is gone): then SIGTERM follows at once. Otherwise they get
    GRACEFUL_STOP_S to exit, then SIGTERM and TERMINATE_STOP_S, then SIGKILL and as long again;
    a child that outlives even that (stuck in the kernel) is logged and left for a later call.
    """
    alive = [c for c in children if not c._closed and c.proc.exitcode is None]
    if alive and ask_to_stop is not None and ask_to_stop():
        _join_all(alive, GRACEFUL_STOP_S)
        for child in _still_running(alive):
            logger.warning(
                "%s (pid %d) did not stop within %.0f s; terminating it",
                child.label,
                child.pid,
                GRACEFUL_STOP_S,
            )
    for child in _still_running(alive):
        child.proc.terminate()
    _join_all(alive, TERMINATE_STOP_S)
    for child in _still_running(alive):
        logger.warning("%s (pid %d) ignored SIGTERM; killing it", child.label, child.pid)
        child.proc.kill()
    _join_all(alive, TERMINATE_STOP_S)
    for child in children:
        if not child._closed and child.proc.exitcode is None:
            # Unkillable for now (in the kernel: a device driver, a dead file system). Its
            # handle stays open so a later call can reap it; we must not hang here.
            logger.error("%s (pid %d) survived SIGKILL; leaving it", child.label, child.pid)
            continue
        child._close()


def _join_all(children: Sequence[ChildProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.proc.join(max(0.0, deadline - time.monotonic()))


def _still_running(children: Sequence[ChildProcess]) -> list[ChildProcess]:
    return [c for c in children if c.proc.exitcode is None]


# -- child side ----------------------------------------------------------------------------------
def report_startup(
    ready_conn: Connection,
    build: Callable[[], T],
    payload: Callable[[T], Any] | None = None,
) -> T:
    """The child's half of the handshake: runs `build()`, answers (READY, payload(built)) and
    returns what it built. If `build` raises, answers (FAILED, type name, traceback) and exits
    the process with code 1; `build` releases what it acquired before it raises.
    """
    try:
        built = build()
    except BaseException as e:
        text = "".join(traceback.format_exception(e))
        with contextlib.suppress(OSError):  # the parent stopped waiting (Ctrl-C, SIGTERM)
            ready_conn.send((FAILED, type(e).__name__, text))
        ready_conn.close()
        raise SystemExit(1) from None
    ready_conn.send((READY, None if payload is None else payload(built)))
    ready_conn.close()
    return built


def watch_parent(
    on_parent_death: Callable[[], None], exit_after_s: float = PARENT_DEATH_EXIT_S
) -> threading.Thread | None:
    """Starts a daemon thread that waits for the parent process to end (even by SIGKILL), then
    runs `on_parent_death()` (remove what the parent can no longer remove, stop this child's
    own children) and ends this process with `os._exit(1)`, within `exit_after_s` whatever the
    main thread is doing.

    Returns:
        The thread, so the main thread can let it finish; None without a parent.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return None
    thread = threading.Thread(
        target=_follow_parent,
        args=(parent.sentinel, on_parent_death, exit_after_s),
        name="v1engine-parent-watch",
        daemon=True,
    )
    thread.start()
    return thread


def _follow_parent(sentinel: int, on_parent_death: Callable[[], None], exit_after_s: float) -> None:
    wait([sentinel])
    timer = threading.Timer(exit_after_s, os._exit, args=(1,))
    timer.daemon = True
    timer.start()
    try:
        on_parent_death()
    except BaseException:
        logger.exception("cleaning up after the parent process died")
    finally:
        os._exit(1)


def install_sigterm_handler() -> None:
    """Makes SIGTERM raise SystemExit(128 + SIGTERM) in the main thread, so `finally` blocks
    and shut-down code run; by default SIGTERM ends the process without them."""
    signal.signal(signal.SIGTERM, _raise_system_exit)


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


# -- addresses -----------------------------------------------------------------------------------
def get_open_port() -> int:
    """A TCP port free on every interface of this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def get_distributed_init_method(ip: str = "127.0.0.1", port: int | None = None) -> str:
    """A torch.distributed rendezvous address, `tcp://ip:port`; a fresh port by default, so two
    engines on one host never collide."""
    return f"tcp://{ip}:{get_open_port() if port is None else port}"
