"""Front-end output processing: the core's token outputs -> user-facing `RequestOutput`s.

Per request the front end detokenizes incrementally, checks stop strings (the core only knows stop
token ids), turns logprob rows into `{token_id: Logprob}` dicts and fans n > 1 children back in
to one output for their parent.

Prompt logprobs arrive chunk by chunk, the last with the first output token; a chunk without
tokens yields no `RequestOutput`. They are computed for child 0 of an n > 1 request only (see
`processor.make_child_requests`) and shown on the parent's outputs.

Stop strings: the text is cut where the earliest stop string starts (kept with
`include_stop_str_in_output`), the request finishes with finish_reason "stop" and stop_reason the
string, and its id is returned in `request_ids_to_abort` for the caller to abort in the core. Text
a client has been shown is never cut later: while a request runs, the longest tail of its text
that is a proper prefix of a stop string is held back (not needed with
`include_stop_str_in_output`: whatever precedes a stop string's end stays in the output). vLLM
holds back `max(len(stop)) - 1` characters; holding back only a real partial match streams sooner.

A pooling engine's request is a `PoolingState`: its one output becomes an
`EmbeddingRequestOutput` or a `ClassificationRequestOutput`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

from v1engine.engine.detokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    find_stop_string,
    partial_stop_len,
)
from v1engine.engine.logprobs import PromptLogprobs, TokenDecoder, logprob_dicts
from v1engine.engine.pooling_state import PooledOutput, PoolingState
from v1engine.outputs import CompletionOutput, Logprob, RequestOutput
from v1engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1engine.outputs import LogprobsLists
    from v1engine.request import EngineCoreOutput

# "cumulative": everything so far, every step; "delta": only what is new, every step (streaming);
# "final": everything, once, when finished (`LLM.generate`, non-streaming HTTP).
OutputKind = Literal["cumulative", "delta", "final"]
_OUTPUT_KINDS = ("cumulative", "delta", "final")


class RequestState:
    """One core request's text, tokens, logprobs and finish status as the front end sees them."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        output_kind: OutputKind,
        tokenizer: Tokenizer | None,
        parent: ParentState | None = None,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_kind = output_kind
        self.parent = parent
        self.index = index
        # A child shares its parent's: only child 0 gets prompt logprobs from the core.
        self.prompt_logprobs = (
            _new_prompt_logprobs(sampling_params) if parent is None else parent.prompt_logprobs
        )
        self.stop = sampling_params.stop
        self.include_stop_str_in_output = sampling_params.include_stop_str_in_output
        # No tokenizer (skip_tokenizer_init) or detokenize=False: token ids only, no text.
        self.detokenizer = None
        if tokenizer is not None and sampling_params.detokenize:
            self.detokenizer = IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                sampling_params.skip_special_tokens,
                sampling_params.spaces_between_special_tokens,
            )
        # Stop strings count only once the output has min_tokens tokens (as vLLM).
        self.min_tokens = sampling_params.min_tokens
        self.output_text = ""
        self.num_visible_chars = 0  # output_text[:num_visible_chars] may be shown to the client
        self.num_sent_chars = 0  # delta mode: what the client has already been sent
        self.token_ids: list[int] = []
        self.num_sent_tokens = 0
        wants_logprobs = sampling_params.logprobs is not None
        self.logprobs: list[dict[int, Logprob]] | None = [] if wants_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if wants_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput, decode_token: TokenDecoder) -> bool:
        """Applies one step's output; returns True when a stop string ended the request here
        while the core still runs it (so the caller must abort it in the core)."""
        self.token_ids.extend(output.new_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        decode = decode_token if self.detokenizer is not None else None  # None: no text
        if self.prompt_logprobs is not None and output.new_prompt_logprobs is not None:
            self.prompt_logprobs.add(output.new_prompt_logprobs, decode)
        if self.logprobs is not None and output.new_logprobs is not None:
            self._add_logprobs(output.new_logprobs, decode)
        core_reason = None if output.finish_reason is None else str(output.finish_reason)
        text_token_ids = output.new_token_ids
        if core_reason == "stop" and not self.include_stop_str_in_output and text_token_ids:
            # EOS or a stop token id: the token stays in token_ids but not in the text (as vLLM).
            text_token_ids = text_token_ids[:-1]
        delta = ""
        if self.detokenizer is not None:
            delta = self.detokenizer.update(text_token_ids, finished=core_reason is not None)
        self.output_text += delta
        held_off = len(self.token_ids) < self.min_tokens
        if not held_off and self._check_stop_strings(len(delta)):
            return core_reason is None
        if core_reason is not None:
            self.finish_reason, self.stop_reason = core_reason, output.stop_reason
            self.num_visible_chars = len(self.output_text)
        elif not self.include_stop_str_in_output:
            held = partial_stop_len(self.output_text, self.stop)
            self.num_visible_chars = len(self.output_text) - held
        else:
            self.num_visible_chars = len(self.output_text)
        return False

    def _check_stop_strings(self, num_new_chars: int) -> bool:
        match = find_stop_string(self.output_text, num_new_chars, self.stop)
        if match is None:
            return False
        stop, start = match
        end = start + len(stop) if self.include_stop_str_in_output else start
        self.output_text = self.output_text[:end]
        self.num_visible_chars = end
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def _add_logprobs(self, rows: LogprobsLists, decode_token: TokenDecoder | None) -> None:
        assert self.logprobs is not None and self.cumulative_logprob is not None
        self.logprobs.extend(logprob_dicts(rows, decode_token))
        for logprobs in rows.logprobs:
            self.cumulative_logprob += logprobs[0]

    def make_completion_output(self) -> CompletionOutput | None:
        """This step's output for the client under `output_kind`, or None (final, unfinished)."""
        if self.output_kind == "final" and not self.finished:
            return None
        text_start, token_start = 0, 0
        if self.output_kind == "delta":
            text_start, token_start = self.num_sent_chars, self.num_sent_tokens
            self.num_sent_chars = self.num_visible_chars
            self.num_sent_tokens = len(self.token_ids)
        return CompletionOutput(
            index=self.index,
            text=self.output_text[text_start : self.num_visible_chars],
            token_ids=self.token_ids[token_start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[token_start:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class ParentState:
    """An n > 1 request: collects its children's outputs into one `RequestOutput`."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        output_kind: OutputKind,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.num_children = sampling_params.n
        self.output_kind = output_kind
        self.prompt_logprobs = _new_prompt_logprobs(sampling_params)
        self.child_ids: dict[int, str] = {}  # index -> child request id, as registered
        self.latest: dict[int, CompletionOutput] = {}  # cumulative/final: last output per child
        self.num_finished = 0
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == self.num_children

    def make_request_output(self, completions: list[CompletionOutput]) -> RequestOutput | None:
        """Folds this step's child outputs in; returns what the client gets now, if anything."""
        self.num_finished += sum(completion.finished() for completion in completions)
        if self.output_kind == "delta":
            outputs = completions
        else:
            self.latest.update((completion.index, completion) for completion in completions)
            if self.output_kind == "final" and not self.finished:
                return None
            outputs = list(self.latest.values())
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=sorted(outputs, key=lambda completion: completion.index),
            finished=self.finished,
            prompt_logprobs=_prompt_logprobs_now(self),
            num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    """Turns `EngineCoreOutput`s into `RequestOutput`s; one per front end (LLM or server).

    Outputs for ids it does not know (aborted, or already stopped by a stop string while the core
    was one step ahead) are ignored.
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState | PoolingState] = {}
        self.parent_states: dict[str, ParentState] = {}
        self._token_text: dict[int, str] = {}  # token id -> decoded alone, for logprobs

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        output_kind: OutputKind = "cumulative",
        parent_id: str | None = None,
        index: int = 0,
    ) -> None:
        """Starts tracking one core request.

        Args:
            request_id: the id the core knows the request by.
            sampling_params: the request's params; for a child of an n > 1 request, the parent's
                (its n is the number of children the parent output waits for).
            output_kind: "cumulative", "delta" (streaming) or "final".
            parent_id, index: set for the children made by `processor.make_child_requests`.

        Raises:
            ValueError: a duplicate id or child index, an unknown output_kind, or index >= n.
        """
        if output_kind not in _OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {_OUTPUT_KINDS}, got {output_kind!r}")
        if request_id in self.request_states:
            raise ValueError(f"request_id {request_id!r} is already running; use a unique id")
        parent = None
        if parent_id is not None:
            parent = self.parent_states.get(parent_id)
            if parent is None:
                parent = ParentState(
                    parent_id, prompt, prompt_token_ids, sampling_params, output_kind
                )
            _add_child(parent, request_id, index, sampling_params.n)
            self.parent_states[parent_id] = parent
        self.request_states[request_id] = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            sampling_params,
            output_kind,
            self.tokenizer,
            parent,
            index,
        )

    def add_pooling_request(self, state: PoolingState) -> None:
        """Starts tracking one pooling request (a pooling engine's; its core id is its id)."""
        if state.request_id in self.request_states:
            raise ValueError(f"request_id {state.request_id!r} is already running; use a unique id")
        self.request_states[state.request_id] = state

    def process_outputs(
        self, engine_core_outputs: Iterable[EngineCoreOutput]
    ) -> tuple[list[RequestOutput | PooledOutput], list[str]]:
        """One step: returns `(request_outputs, request_ids_to_abort)`.

        `request_outputs` has at most one entry per request (an n > 1 parent's children folded
        into one); `request_ids_to_abort` are the requests a stop string finished, which the
        caller must abort in the core. Finished requests are forgotten.
        """
        request_outputs: list[RequestOutput | PooledOutput] = []
        request_ids_to_abort: list[str] = []
        child_completions: dict[str, list[CompletionOutput]] = {}
        for output in engine_core_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue
            if isinstance(state, PoolingState):  # its one output, with its finish
                del self.request_states[state.request_id]
                request_outputs.append(state.make_output(output))
                continue
            if state.update(output, self._decode_token):
                request_ids_to_abort.append(state.request_id)
            if not output.new_token_ids and not state.finished:
                continue  # a prefill chunk's prompt logprobs: shown with the first token
            if state.finished:
                del self.request_states[state.request_id]
            completion = state.make_completion_output()
            parent = state.parent
            if parent is not None:
                parent.num_cached_tokens = max(parent.num_cached_tokens, state.num_cached_tokens)
            if completion is None:
                continue
            if parent is not None:
                child_completions.setdefault(parent.request_id, []).append(completion)
            else:
                request_outputs.append(_make_request_output(state, completion))
        for parent_id, completions in child_completions.items():
            parent = self.parent_states[parent_id]
            request_output = parent.make_request_output(completions)
            if parent.finished:
                del self.parent_states[parent_id]
            if request_output is not None:
                request_outputs.append(request_output)
        return request_outputs, request_ids_to_abort

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forgets the given requests; returns the core request ids the caller should abort.

        An id may be a plain request, an n > 1 parent or one of its children; a parent is
        aborted with all its children. Unknown ids (already finished) are ignored.
        """
        aborted: list[str] = []
        for request_id in request_ids:
            state = self.request_states.get(request_id)
            if state is not None and state.parent is not None:
                request_id = state.parent.request_id
            parent = self.parent_states.pop(request_id, None)
            family = [request_id] if parent is None else list(parent.child_ids.values())
            for core_request_id in family:
                if self.request_states.pop(core_request_id, None) is not None:
                    aborted.append(core_request_id)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text


def _add_child(parent: ParentState, child_id: str, index: int, n: int) -> None:
    if not 0 <= index < n:
        raise ValueError(
            f"child index {index} of {parent.request_id!r} is outside [0, n={n}); "
            "pass the parent's sampling_params (not the child's n=1 copy)"
        )
    if index in parent.child_ids:
        raise ValueError(f"child index {index} of {parent.request_id!r} was already added")
    parent.child_ids[index] = child_id


def _make_request_output(state: RequestState, completion: CompletionOutput) -> RequestOutput:
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=[completion],
        finished=state.finished,
        prompt_logprobs=_prompt_logprobs_now(state),
        num_cached_tokens=state.num_cached_tokens,
    )


# These two stay here, not in logprobs.py, so that a request without prompt logprobs never
# enters that module.
def _new_prompt_logprobs(sampling_params: SamplingParams) -> PromptLogprobs | None:
    return None if sampling_params.prompt_logprobs is None else PromptLogprobs()


def _prompt_logprobs_now(
    state: RequestState | ParentState,
) -> list[dict[int, Logprob] | None] | None:
    """What a RequestOutput carries now (see PromptLogprobs.for_output)."""
    if state.prompt_logprobs is None:
        return None
    return state.prompt_logprobs.for_output(state.output_kind)
