"""RpcCall: one `collective_rpc` call, checked by one rule and sent in one form.

What a worker can be asked to run:
- a public method of the worker class, by name (`"execute_model"`), run as
  `worker.method(*args, **kwargs)`;
- an importable function, run as `fn(worker, *args, **kwargs)`: a module-level function, or a
  method given as `Class.method`. The receiving process finds it again by module and qualified
  name, so those must lead back to the very same object: lambdas, functions defined inside
  functions and methods bound to an instance are refused when the RpcCall is built, before
  anything is sent.
The method name is checked by `check()` against the worker class's `WorkerMethods`, which each
worker reports in its READY message (so the engine core never imports the worker's module, nor
torch with it); the rest at construction, on every side.

Wire form (`to_wire()` / `from_wire()`, for the client -> engine-core socket), msgpack-able:
    {"method": str, "is_function": bool, "args": list, "kwargs": dict[str, Any],
     "timeout": float | None, "unique_reply_rank": int | None}
where a function's "method" is "module:qualname": code never crosses the socket. Between the
executor and its workers the RpcCall object itself travels, pickled as its five fields with a
function as its "module:qualname" path, imported again on unpickling: a function the workers
cannot import (say one defined under `if __name__ == "__main__":`) fails that call on every
rank with an error naming it, instead of making a message no worker can read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_WHAT_TO_PASS = (
    "collective_rpc takes the name of a public method of the worker class, or a module-level "
    "function (or a method as Class.method) that the worker processes can import, called as "
    "fn(worker, *args, **kwargs)"
)


@dataclass(frozen=True)
class WorkerMethods:
    """What a worker class can be asked to run by name: its public callables."""

    class_name: str
    names: frozenset[str]

    @classmethod
    def of(cls, worker_cls: type) -> WorkerMethods:
        names = (n for n in dir(worker_cls) if not n.startswith("_"))
        return cls(
            worker_cls.__qualname__, frozenset(n for n in names if callable(getattr(worker_cls, n)))
        )


@dataclass(frozen=True)
class RpcCall:
    """Args:
        method: a worker method name, or an importable function (see the module docstring).
        args / kwargs: the call's arguments; any list or tuple becomes a tuple.
        timeout: seconds to wait for every reply; None waits forever.
        unique_reply_rank: only this rank's result is returned; None returns all of them.

    Raises:
        ValueError: a function the workers cannot import, or a bad timeout.
        TypeError: arguments of the wrong type.
    """

    method: str | Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None
    unique_reply_rank: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.args, (tuple, list)):
            raise TypeError(f"collective_rpc args must be a tuple, got {type(self.args).__name__}")
        kwargs = {} if self.kwargs is None else self.kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise TypeError(f"collective_rpc kwargs must be a dict with str keys, got {kwargs!r}")
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", kwargs)
        if not isinstance(self.method, str):
            _check_importable(self.method)
        _check_timeout(self.timeout)
        if self.unique_reply_rank is not None and (
            isinstance(self.unique_reply_rank, bool) or not isinstance(self.unique_reply_rank, int)
        ):
            raise TypeError(
                f"unique_reply_rank must be an int or None, got {self.unique_reply_rank!r}"
            )

    @property
    def name(self) -> str:
        """The method as errors and logs name it: "execute_model" or "module.qualname"."""
        if isinstance(self.method, str):
            return self.method
        if isinstance(self.method, _FunctionPath):
            return self.method.path.replace(":", ".")
        return f"{self.method.__module__}.{self.method.__qualname__}"

    def check(self, worker_methods: WorkerMethods, world_size: int) -> None:
        """The part of the rule that needs the receiving side: a method name must be one of
        the worker class's `worker_methods`, and `unique_reply_rank` one of the `world_size`
        ranks.

        Raises:
            ValueError: the call cannot run; the caller has sent nothing yet.
        """
        if isinstance(self.method, str) and self.method not in worker_methods.names:
            raise ValueError(
                f"unknown RPC method {self.method!r} for worker class "
                f"{worker_methods.class_name}; public methods: {sorted(worker_methods.names)}"
            )
        rank = self.unique_reply_rank
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"unique_reply_rank must be in [0, {world_size}) or None, got {rank}")

    def run_on(self, worker: Any) -> Any:
        """Runs the call on this process's worker and returns its result.

        Raises:
            ValueError: the call's function cannot be imported in this process.
        """
        if isinstance(self.method, _FunctionPath):  # not importable here: raises why
            _import_function(self.method.path)
        if isinstance(self.method, str):
            return getattr(worker, self.method)(*self.args, **self.kwargs)
        return self.method(worker, *self.args, **self.kwargs)

    def __reduce__(self) -> tuple:
        # The worker queue pickles one call per step: its five fields cost half of a
        # dataclass's default pickling, and the workers do not check the call a second time.
        method = self.method
        if not isinstance(method, (str, _FunctionPath)):
            method = _FunctionPath(_function_path(method))
        return _unpickle, (
            method,
            self.args,
            self.kwargs,
            self.timeout,
            self.unique_reply_rank,
        )

    # -- wire form ----------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able form (module docstring); the arguments must be msgpack-able too."""
        is_function = not isinstance(self.method, str)
        return {
            "method": _function_path(self.method) if is_function else self.method,
            "is_function": is_function,
            "args": list(self.args),
            "kwargs": self.kwargs,
            "timeout": self.timeout,
            "unique_reply_rank": self.unique_reply_rank,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> RpcCall:
        """Rebuilds a call from `to_wire()`'s form, importing a function here.

        Raises:
            ValueError: the form is malformed, or the function cannot be imported here.
            TypeError: a field has the wrong type.
        """
        if not isinstance(wire, dict) or not isinstance(wire.get("method"), str):
            raise ValueError(f"malformed collective_rpc call {wire!r}: it needs a str 'method'")
        method: str | Callable[..., Any] = wire["method"]
        if wire.get("is_function", False):
            method = _import_function(wire["method"])
        return cls(
            method,
            wire.get("args", ()),
            wire.get("kwargs", {}),
            wire.get("timeout"),
            wire.get("unique_reply_rank"),
        )


@dataclass(frozen=True)
class _FunctionPath:
    """A function as a pickled call carries it: its "module:qualname", imported on use."""

    path: str


def _unpickle(
    method: str | _FunctionPath,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float | None,
    unique_reply_rank: int | None,
) -> RpcCall:
    """A pickled RpcCall, rebuilt without running the checks it passed when it was built (a
    function that cannot be imported here stays a path, for `run_on` to fail with)."""
    if isinstance(method, _FunctionPath):
        try:
            method = _import_function(method.path)
        except Exception:  # whatever importing its module raised, `run_on` raises again
            pass
    call = object.__new__(RpcCall)
    fields = call.__dict__  # frozen: assigning attributes would raise
    fields["method"] = method
    fields["args"] = args
    fields["kwargs"] = kwargs
    fields["timeout"] = timeout
    fields["unique_reply_rank"] = unique_reply_rank
    return call


def _function_path(function: Callable[..., Any]) -> str:
    return f"{function.__module__}:{function.__qualname__}"


def _check_importable(function: Any) -> None:
    """Raises unless `function` is found again by its module and qualified name."""
    if not callable(function):
        raise TypeError(f"{_WHAT_TO_PASS}; got a {type(function).__name__}")
    module_name = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", None)
    if not module_name or not qualname:
        problem = "it has no module and qualified name (a partial or a callable object?)"
    elif "<" in qualname:
        problem = f"{qualname!r} is a lambda or is defined inside a function"
    else:
        try:
            found = _resolve(module_name, qualname)
        except (ImportError, AttributeError):
            found = None
        if found == function:
            return
        problem = (
            f"{module_name}:{qualname} does not lead back to it (a method bound to an instance, "
            "or a function replaced by a decorator?)"
        )
    raise ValueError(f"{_WHAT_TO_PASS}; got {function!r}: {problem}")


def _resolve(module_name: str, qualname: str) -> Any:
    found: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _import_function(path: str) -> Callable[..., Any]:
    """`module:qualname` -> the function it names."""
    module_name, _, qualname = path.partition(":")
    try:
        return _resolve(module_name, qualname)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(
            f"collective_rpc function {path!r} cannot be imported in this process ({e}); pass a "
            "module-level function importable from sys.path"
        ) from e


def _check_timeout(timeout: Any) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"collective_rpc timeout must be seconds or None, got {timeout!r}")
    if timeout < 0:
        raise ValueError(f"collective_rpc timeout must be >= 0 seconds or None, got {timeout}")
