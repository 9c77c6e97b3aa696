"""Helpers for the engine-process tests: requests and collecting their outputs (process and
leftover checks live in tests/process_utils.py)."""

from __future__ import annotations

import time

from v1engine.request import EngineCoreRequest
from v1engine.sampling_params import SamplingParams


def core_request(request_id: str, prompt: list[int], max_tokens: int = 4) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens))


def collect(client, request_ids: set[str], timeout_s: float = 10.0) -> dict:
    """Outputs until every request in `request_ids` finished: id -> (tokens, finish reason)."""
    results: dict[str, tuple[list[int], str | None]] = {}
    deadline = time.monotonic() + timeout_s
    while not all(results.get(r, ([], None))[1] for r in request_ids):
        for out in client.get_output(timeout=max(0.0, deadline - time.monotonic())).outputs:
            tokens = results.get(out.request_id, ([], None))[0] + out.new_token_ids
            results[out.request_id] = (tokens, out.finish_reason and str(out.finish_reason))
    return results
