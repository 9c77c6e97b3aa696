"""The front end's side of generation: detokenization, stop strings, n > 1 fan-in, logprobs, and
the user-facing `RequestOutput`s built from the core's `EngineCoreOutput`s."""

from __future__ import annotations

from v1engine.engine.detokenizer import IncrementalDetokenizer
from v1engine.engine.output_processor import OutputKind, OutputProcessor, make_child_requests
from v1engine.engine.request_output import CompletionOutput, Logprob, RequestOutput

__all__ = [
    "CompletionOutput",
    "IncrementalDetokenizer",
    "Logprob",
    "OutputKind",
    "OutputProcessor",
    "RequestOutput",
    "make_child_requests",
]
