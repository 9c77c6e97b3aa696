"""LLM's progress bar (`offline_inputs.RequestProgress`): it counts finished requests, and for
generated ones tallies every prompt token and every completion's tokens for vLLM's speed
estimate; pooled outputs and a disabled bar tally nothing."""

from __future__ import annotations

import io

from tqdm import tqdm

from v1engine.entrypoints.offline_inputs import RequestProgress
from v1engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)


def _generated(num_prompt_tokens: int, *num_tokens: int) -> RequestOutput:
    completions = [
        CompletionOutput(i, "", list(range(n)), None, None, "length")
        for i, n in enumerate(num_tokens)
    ]
    return RequestOutput("r", None, list(range(num_prompt_tokens)), completions, True)


def test_the_bar_tallies_prompt_and_output_tokens():
    def make_bar(**kwargs):
        return tqdm(file=io.StringIO(), **kwargs)

    with RequestProgress(make_bar, 3, "Generating") as progress:
        progress.finished(_generated(5, 3))
        progress.finished(_generated(2, 4, 6))  # n = 2: both completions count
        progress.finished(EmbeddingRequestOutput("e", EmbeddingOutput([0.0]), [1, 2, 3]))
    assert progress.bar.n == 3
    assert (progress.prompt_tokens, progress.output_tokens) == (7, 13)
    assert progress.bar.postfix.startswith("est. speed input: ")
    with RequestProgress(False, 1, "Generating") as quiet:
        quiet.finished(_generated(5, 3))
    assert quiet.prompt_tokens == quiet.output_tokens == 0  # a disabled bar shows nothing
