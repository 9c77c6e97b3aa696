"""`use_beam_search`: which request fields a beam search takes, and its `BeamSearchParams`.

A search scores sequences by their logprobs, so the fields that change sampling (penalties,
biases, stop strings, constraints, seeds) or ask for logprobs would be silently ignored by it (as
vLLM ignores them); here they are a 400 naming the field instead.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from v1engine.engine.beam_search import over_max_logprobs
from v1engine.entrypoints.openai.errors import APIError
from v1engine.sampling_params import BeamSearchParams, SamplingParams

# The SamplingParams fields a search honours: n is its width, the prompt is cut as asked.
_SEARCH_FIELDS = (
    "n",
    "max_tokens",
    "temperature",
    "ignore_eos",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
)


def beam_search_params(request: Any, params: SamplingParams, max_logprobs: int) -> BeamSearchParams:
    """The request's search: width n, the request's max_tokens, temperature (0 when left out)
    and length_penalty.

    Raises:
        APIError: 400 naming a field the search does not take, or an n whose 2 * n candidates
            per step are over the server's max_logprobs.
    """
    plain = SamplingParams(**{name: getattr(params, name) for name in _SEARCH_FIELDS})
    unsupported = [
        f.name
        for f in fields(SamplingParams)
        if not f.name.startswith("_") and getattr(params, f.name) != getattr(plain, f.name)
    ]
    if request.priority != 0:  # its steps are scheduled as any request's
        unsupported.append("priority")
    if request.cache_salt is not None:  # its steps share the prefix cache unsalted
        unsupported.append("cache_salt")
    if unsupported:
        raise APIError(
            f"use_beam_search does not take {', '.join(unsupported)}: a beam search takes n (the "
            "beam width), max_tokens, temperature, ignore_eos, length_penalty, "
            "include_stop_str_in_output and truncate_prompt_tokens; drop the others",
            param=unsupported[0],
        )
    too_wide = over_max_logprobs(params.n, max_logprobs)
    if too_wide:
        raise APIError(
            f"n: a beam search of width {params.n} {too_wide}; lower n, or restart the server "
            "with a higher --max-logprobs",
            param="n",
        )
    assert params.max_tokens is not None  # the serving layer fills in the context's room
    return BeamSearchParams(
        beam_width=params.n,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        temperature=0.0 if request.temperature is None else params.temperature,
        length_penalty=request.length_penalty,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )
