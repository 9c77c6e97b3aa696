"""UniProcExecutor: the worker lives in the engine's own process (tests, one device).

Same contract as MultiprocExecutor, minus what a single process cannot do: a call cannot be
interrupted, so `timeout` is not enforced, and a Future from `non_block` is already complete.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from v1engine.executor.abstract import Executor, build_worker, get_worker_class
from v1engine.executor.errors import RemoteFailure, WorkerError
from v1engine.executor.rpc_call import RpcCall, WorkerMethods
from v1engine.process import get_distributed_init_method


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        worker_cls = get_worker_class(self.config.parallel_config)
        self.worker = build_worker(
            worker_cls,
            self.config,
            rank=0,
            local_rank=0,
            distributed_init_method=get_distributed_init_method(),
        )
        self.worker_methods = WorkerMethods.of(worker_cls)
        self._is_shut_down = False

    def _run_rpc(self, call: RpcCall, non_block: bool, lockstep: bool) -> Any:
        # One worker: no peer can be stranded, so `lockstep` changes nothing.
        if self._is_shut_down:
            raise RuntimeError("the executor has been shut down")
        future: Future = Future()
        try:
            result = call.run_on(self.worker)
        except Exception as e:
            future.set_exception(WorkerError(call.name, [RemoteFailure.from_exception(0, e)]))
        else:
            future.set_result(result if call.unique_reply_rank is not None else [result])
        return future if non_block else future.result()

    def shutdown(self) -> None:
        if not self._is_shut_down:
            self._is_shut_down = True
            self.worker.shutdown()
