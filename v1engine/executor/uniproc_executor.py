"""UniProcExecutor: the worker lives in the engine's own process (tests, one device).

Same contract as MultiprocExecutor, minus what a single process cannot do: a call cannot be
interrupted, so `timeout` is not enforced, and a Future from `non_block` is already complete.
"""

from __future__ import annotations

import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

from v1engine.executor.abstract import (
    Executor,
    check_rpc_method,
    check_unique_reply_rank,
    completed_future,
)
from v1engine.executor.errors import RemoteFailure, WorkerError


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        self.worker = self.worker_cls(
            config=self.config,
            local_rank=0,
            rank=0,
            distributed_init_method=init_method,
            is_driver_worker=True,
        )
        try:
            self.worker.init_device()
            self.worker.load_model()
        except BaseException:
            self.worker.shutdown()
            raise
        self._is_shut_down = False

    def collective_rpc(
        self,
        method: str | Callable,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        non_block: bool = False,
    ) -> Any:
        name = check_rpc_method(self.worker_cls, method)
        check_unique_reply_rank(unique_reply_rank, world_size=1)
        if self._is_shut_down:
            raise RuntimeError("the executor has been shut down")
        fn = getattr(self.worker, method) if isinstance(method, str) else method
        call_args = args if isinstance(method, str) else (self.worker, *args)
        try:
            result = fn(*call_args, **(kwargs or {}))
        except Exception:
            exc = sys.exc_info()[1]
            failure = RemoteFailure(0, type(exc).__name__, str(exc), traceback.format_exc())
            error = WorkerError(name, [failure])
            if non_block:
                return completed_future(error=error)
            raise error from exc
        result = result if unique_reply_rank is not None else [result]
        return completed_future(result) if non_block else result

    def shutdown(self) -> None:
        if not self._is_shut_down:
            self._is_shut_down = True
            self.worker.shutdown()
