"""Beam search over the engine's one-token steps, as vLLM runs it: each step sends every live
beam as a prompt asking for one token with its `2 * beam_width` most likely candidates
(logprobs); the prefix cache makes a re-sent beam cost only its last, partial block.

`BeamSearch` is one prompt's search, with no model and no engine: it says which prompts the next
step sends and takes each beam's candidates back. `LLM.beam_search` drives many at once (one
`generate` per step); `AsyncLLM.beam_search` drives one per API request.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from v1engine.engine.processor import as_parent_error
from v1engine.outputs import CompletionOutput, Logprob, RequestOutput, final_output
from v1engine.sampling_params import BeamSearchParams, SamplingParams

# Decodes token ids to text.
Decode = Callable[[list[int]], str]


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's then the generated ones; `logprobs` has one dict per
    generated token, the candidates its step offered. `finish_reason`: "stop" (EOS) or
    "length" (max_tokens or the context reached)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None  # None, as for a CompletionOutput that ended on EOS


@dataclass
class BeamSearchOutput:
    """One prompt's result: its `beam_width` best sequences, best first."""

    sequences: list[BeamSearchSequence]


def step_params(params: BeamSearchParams) -> SamplingParams:
    """What every beam asks of one step: one token and its candidates."""
    return SamplingParams(
        max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width
    )


def over_max_logprobs(beam_width: int, max_logprobs: int) -> str | None:
    """Why a search this wide cannot run on an engine with this max_logprobs (each step asks
    for 2 * beam_width candidates; -1: no bound), or None when it can."""
    candidates = 2 * beam_width
    if max_logprobs == -1 or candidates <= max_logprobs:
        return None
    return (
        f"reads {candidates} logprobs per step, over this engine's max_logprobs of {max_logprobs}"
    )


def step_candidates(output: RequestOutput) -> dict[int, Logprob]:
    """A finished one-token step's candidates (the sampled token's and the top ones)."""
    logprobs = output.outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == 1, "a step is one token with logprobs"
    return logprobs[0]


class BeamSearch:
    """Args:
    prompt_token_ids: the prompt (checked by the engine when the first step is sent).
    params: the search's width, length and scoring.
    eos_token_id: the model's EOS, which ends a beam unless `params.ignore_eos`.
    max_model_len: the context: a beam that fills it ends with "length".
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        eos_token_id: int | None,
        max_model_len: int,
    ) -> None:
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.eos_token_id = None if params.ignore_eos else eos_token_id
        self.max_model_len = max_model_len
        self.beams = [BeamSearchSequence(self.prompt_token_ids)]  # live, best first
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.num_steps >= self.params.max_tokens

    def prompts(self) -> list[list[int]]:
        """The next step's prompts: the live beams' tokens, in `beams` order."""
        return [beam.tokens for beam in self.beams]

    def advance(self, candidates: list[dict[int, Logprob]]) -> None:
        """Takes one step's candidates, one dict per live beam in `beams` order; keeps the
        `beam_width` best extensions that did not end on EOS (those that did are completed)."""
        assert len(candidates) == len(self.beams), "one candidate dict per live beam"
        extended = []
        for beam, options in zip(self.beams, candidates):
            for token_id, logprob in options.items():
                if logprob.logprob == -math.inf:  # a banned token, never a beam
                    continue
                sequence = BeamSearchSequence(
                    beam.tokens + [token_id],
                    beam.logprobs + [options],
                    beam.cum_logprob + logprob.logprob,
                )
                if token_id == self.eos_token_id:
                    sequence.finish_reason = "stop"
                    self.completed.append(sequence)
                else:
                    extended.append(sequence)
        extended.sort(key=self.score, reverse=True)
        self.beams = []
        for beam in extended[: self.params.beam_width]:
            if len(beam.tokens) >= self.max_model_len:  # no room for another token
                beam.finish_reason = "length"
                self.completed.append(beam)
            else:
                self.beams.append(beam)
        self.num_steps += 1

    def score(self, sequence: BeamSearchSequence) -> float:
        """Cumulative logprob over length ** length_penalty; the length counts the prompt but
        not a final EOS (vLLM's rule)."""
        length = len(sequence.tokens) - (sequence.finish_reason == "stop")
        return sequence.cum_logprob / length**self.params.length_penalty

    def best(self) -> list[BeamSearchSequence]:
        """The `beam_width` best sequences, finished or cut by max_tokens, best first; an EOS
        that ended one stays in its tokens only with `include_stop_str_in_output`."""
        cut = [replace(beam, finish_reason="length") for beam in self.beams]
        ranked = sorted(self.completed + cut, key=self.score, reverse=True)
        best = ranked[: self.params.beam_width]
        if self.params.include_stop_str_in_output:
            return best
        return [replace(s, tokens=s.tokens[:-1]) if s.finish_reason == "stop" else s for s in best]

    def output(self, decode: Decode | None) -> BeamSearchOutput:
        """`LLM.beam_search`'s result: each sequence's text is its prompt and output (vLLM's)."""
        sequences = self.best()
        if decode is not None:
            for sequence in sequences:
                sequence.text = decode(sequence.tokens)
        return BeamSearchOutput(sequences)

    def request_output(
        self, request_id: str, prompt: str | None, decode: Decode | None, num_cached_tokens: int
    ) -> RequestOutput:
        """The API's result: one finished RequestOutput whose completions are the sequences'
        outputs (text and tokens after the prompt), best first."""
        num_prompt_tokens = len(self.prompt_token_ids)
        completions = []
        for index, sequence in enumerate(self.best()):
            token_ids = sequence.tokens[num_prompt_tokens:]
            text = "" if decode is None else decode(token_ids)
            completions.append(
                CompletionOutput(
                    index, text, token_ids, sequence.cum_logprob, None, sequence.finish_reason
                )
            )
        return RequestOutput(
            request_id,
            prompt,
            self.prompt_token_ids,
            completions,
            finished=True,
            num_cached_tokens=num_cached_tokens,
        )


# One step's engine requests: each one's id and outputs.
Steps = list[tuple[str, AsyncIterator[RequestOutput]]]


class AsyncBeamSearch:
    """One API request's search driven over an asyncio engine (an AsyncLLM: its `add_request`
    and `abort`): each step's requests are named f"{request_id}-beam{step}-{i}"; what runs
    when the search ends early is aborted."""

    def __init__(
        self, engine: Any, request_id: str, search: BeamSearch, lora_request: Any = None
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.search = search
        self.lora_request = lora_request  # every step runs with the search's adapter
        self.one_step = step_params(search.params)

    @classmethod
    async def start(
        cls,
        engine: Any,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        lora_request: Any = None,
    ) -> tuple[asyncio.Task, asyncio.Queue]:
        """Adds the search's first step and starts its task (`run`); returns the task and the
        queue its output comes on. Raises ValueError when the prompt cannot be served, named
        for `request_id`."""
        info, eos_token_id = engine.client.info, engine.processor.eos_token_id
        beams = BeamSearch(prompt_token_ids, params, eos_token_id, info.max_model_len)
        search = cls(engine, request_id, beams, lora_request)
        try:
            first = await search.add_step()
        except ValueError as e:
            raise as_parent_error(e, f"{request_id}-beam0-0", request_id) from e
        queue: asyncio.Queue = asyncio.Queue()
        tokenizer = engine.output_processor.tokenizer
        decode = None if tokenizer is None else partial(tokenizer.decode, skip_special_tokens=True)
        task = asyncio.get_running_loop().create_task(search.run(prompt, first, decode, queue))
        return task, queue

    async def add_step(self) -> Steps:
        """Adds the search's next step, one request per live beam; if one cannot be added,
        those added are aborted."""
        steps: Steps = []
        try:
            for i, tokens in enumerate(self.search.prompts()):
                step_id = f"{self.request_id}-beam{self.search.num_steps}-{i}"
                outputs = await self.engine.add_request(
                    step_id, None, tokens, self.one_step, "final", lora_request=self.lora_request
                )
                steps.append((step_id, outputs))
        except BaseException:
            for step_id, _ in steps:
                self.engine.abort(step_id)
            raise
        return steps

    async def run(
        self, prompt: str | None, steps: Steps, decode: Decode | None, queue: asyncio.Queue
    ) -> None:
        """The search's steps from `steps` (the first, added), then its output (or the error
        that ended it) on `queue`."""
        search, num_cached_tokens = self.search, None
        try:
            while True:
                finals = await asyncio.gather(*(final_output(outputs) for _, outputs in steps))
                if num_cached_tokens is None:  # the first step's is the prompt's
                    num_cached_tokens = finals[0].num_cached_tokens
                search.advance([step_candidates(final) for final in finals])
                if search.done:
                    break
                steps = await self.add_step()
            output = search.request_output(self.request_id, prompt, decode, num_cached_tokens)
            queue.put_nowait(output)
        except Exception as e:  # the reader raises it (EngineDeadError: a 503)
            queue.put_nowait(e)
        finally:  # cancelled (aborted) while a step runs: its requests are still in the core
            for step_id, _ in steps:
                self.engine.abort(step_id)
