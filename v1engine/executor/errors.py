"""Errors that cross the process boundary between the engine and its workers."""

from __future__ import annotations

import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteFailure:
    """One rank's exception, as text: the object itself may not be picklable."""

    rank: int
    exc_type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, rank: int, error: BaseException) -> RemoteFailure:
        text = "".join(traceback.format_exception(error))
        return cls(rank, type(error).__name__, str(error), text)


class WorkerError(RuntimeError):
    """A worker method raised. The message names every failing rank with its traceback.

    Args:
        method: the call, as `RpcCall.name` gives it.
        failures: one per failing rank, in rank order.
        note: what became of the worker group, when the failure ended it.

    Attributes:
        summary: one line naming the method and each failing rank with its exception, without
            tracebacks: what a client is told while the whole message goes to the log.
    """

    def __init__(self, method: str, failures: list[RemoteFailure], note: str = "") -> None:
        self.method = method
        self.failures = failures
        self.summary = f"collective_rpc({method!r}) failed on " + ", ".join(
            f"rank {f.rank} ({f.exc_type}: {f.message})" for f in failures
        )
        ranks = ", ".join(f"rank {f.rank}" for f in failures)
        parts = [f"collective_rpc({method!r}) failed on {ranks}:"]
        if note:
            parts.append(note)
        for f in failures:
            parts.append(f"--- rank {f.rank}: {f.exc_type}: {f.message}\n{f.traceback.rstrip()}")
        super().__init__("\n".join(parts))


class WorkerDiedError(RuntimeError):
    """A worker process (or the Ray actor or node holding it) is gone; every pending and later
    call raises this.

    Args:
        rank: the dead worker's rank.
        cause: how it died, e.g. `describe_exitcode(code)` or Ray's reason for an actor's death.
        method: the call that was pending, if any.
    """

    def __init__(self, rank: int, cause: str, method: str | None = None) -> None:
        self.rank = rank
        self.cause = cause
        during = f" during collective_rpc({method!r})" if method else ""
        super().__init__(
            f"worker rank {rank} died ({cause}){during}; "
            "the executor cannot be used any more: shut it down and start a new engine"
        )
