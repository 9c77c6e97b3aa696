"""StructuredOutputManager: the engine core's side of structured outputs (xgrammar).

A request with `SamplingParams.structured_outputs` goes through these states:
1. `grammar_init` (when the scheduler queues it): its grammar is submitted to the backend's thread
   pool (a cached grammar is ready at once) and the request waits as WAITING_FOR_FSM, which the
   scheduler skips without holding up the queue behind it.
2. `update_waiting` (each schedule that has requests still compiling): once compiled, the
   request gets its own matcher (n > 1 children each have one) and becomes WAITING. A compile
   that failed or ran past the time-out raises ValueError, and the scheduler finishes the
   request with "error".
3. `grammar_bitmask` (each step): for the structured requests that sample this step, one packed
   int32 row each of the tokens their matcher allows next, and under speculative decoding one
   more per draft the step verifies (what the matcher allows after the drafts before that row);
   it travels in the SchedulerOutput and the sampling rank masks the logits with it. Drafts are
   checked against the grammar when they arrive (`valid_drafts`), so each bitmask row follows
   tokens the grammar accepts; the matcher is rolled back over them at once.
4. `accept_token` (update_from_output): the matcher advances over each sampled token; a grammar
   that has terminated (its stop token accepted) finishes the request with "stop".

A request whose params carry a reasoning end token (the server's reasoning parser sets it) thinks
first: until it samples that token its bitmask rows allow everything and its matcher sees
nothing; the grammar governs what follows.

The matcher follows the output tokens only, and preemption keeps those: a recomputed request
resumes with the matcher as it was, and needs no rollback.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from v1engine.config import ModelConfig
from v1engine.logger import init_logger
from v1engine.request import Request, RequestStatus
from v1engine.structured_outputs.backend import (
    DEFAULT_COMPILE_TIMEOUT_S,
    GrammarBackend,
    compile_timeout_message,
    import_xgrammar,
)
from v1engine.tokenizer import load_tokenizer as load_tokenizer_from

if TYPE_CHECKING:
    import xgrammar as xgr

logger = init_logger(__name__)


class StructuredOutputRequest:
    """One request's grammar: its compile, then its matcher."""

    def __init__(
        self,
        future: Future[xgr.CompiledGrammar],
        deadline: float,
        reasoning_end_token_id: int | None = None,
    ) -> None:
        self.future = future
        self.deadline = deadline  # on time.monotonic()'s clock
        self.matcher: xgr.GrammarMatcher | None = None
        # Still thinking: the grammar starts after this token (None: from the first token).
        self.reasoning_end_token_id = reasoning_end_token_id


class StructuredOutputManager:
    """Args:
    model_config: where the tokenizer is loaded from (on first use, on a compile thread).
    vocab_size: the model's logits width (the bitmask covers it).
    compile_timeout_s: a grammar not compiled by then fails its request.
    load_tokenizer: returns the tokenizer (default: `model_config`'s, loaded from disk).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        vocab_size: int,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        load_tokenizer: Callable[[], Any] | None = None,
    ) -> None:
        self.model_config = model_config
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.load_tokenizer = load_tokenizer or (lambda: load_tokenizer_from(model_config))
        # Built on the first structured request: an engine that never sees one never loads a
        # tokenizer or starts a thread.
        self._backend: GrammarBackend | None = None

    def _get_backend(self) -> GrammarBackend:
        if self._backend is None:
            config = self.model_config
            tokenizer_key = config.tokenizer or config.model
            if tokenizer_key is None:
                raise ValueError("structured outputs need a model with a tokenizer")
            self._backend = GrammarBackend(tokenizer_key, self.load_tokenizer, self.vocab_size)
        return self._backend

    def grammar_init(self, request: Request) -> None:
        """Starts compiling the request's grammar; the request waits for it."""
        params = request.sampling_params.structured_outputs
        assert params is not None and request.status == RequestStatus.WAITING
        future = self._get_backend().compile_async(params)
        deadline = time.monotonic() + self.compile_timeout_s
        request.structured_output_request = StructuredOutputRequest(
            future, deadline, params._reasoning_end_token_id
        )
        request.status = RequestStatus.WAITING_FOR_FSM

    def update_waiting(self, compiling: Iterable[Request]) -> list[Request]:
        """Makes the requests (WAITING_FOR_FSM) whose grammar compiled WAITING; returns those
        whose compile failed or ran past the time-out (logged here), for the scheduler to
        finish."""
        failed = []
        for request in compiling:
            try:
                if self._is_grammar_ready(request):
                    request.status = RequestStatus.WAITING
            except ValueError as e:
                logger.error("request %s failed: %s", request.request_id, e)
                failed.append(request)
        return failed

    def _is_grammar_ready(self, request: Request) -> bool:
        """Whether the grammar compiled (then the request has its matcher).

        Raises:
            ValueError: the compile failed or ran past the time-out; says which grammar.
        """
        so_request = request.structured_output_request
        if not so_request.future.done():
            if time.monotonic() < so_request.deadline:
                return False
            params = request.sampling_params.structured_outputs
            raise ValueError(compile_timeout_message(params, self.compile_timeout_s))
        # A failed compile re-raises its ValueError here.
        so_request.matcher = import_xgrammar().GrammarMatcher(so_request.future.result())
        return True

    def wait_for_grammars(self, waiting: Iterable[Request], timeout_s: float) -> None:
        """Blocks until a waiting request's grammar compiles, or `timeout_s` passes (at once
        when none is compiling): an engine with nothing else to do waits here, not spinning."""
        futures = [
            r.structured_output_request.future
            for r in waiting
            if r.status == RequestStatus.WAITING_FOR_FSM
        ]
        if futures:
            concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def grammar_bitmask(self, requests: list[Request], drafts: list[list[int]]) -> np.ndarray:
        """[rows, ceil(vocab_size / 32)] int32, a row per request and one more per draft it
        verifies (`drafts`, by request; the drafts `valid_drafts` kept): a row's bit t is set iff
        its request may sample token t after the drafts before that row (xgrammar's packing:
        token t is bit t % 32 of word t // 32)."""
        num_rows = sum(1 + len(request_drafts) for request_drafts in drafts)
        bitmask = import_xgrammar().allocate_token_bitmask(num_rows, self.vocab_size)
        row = 0
        for request, request_drafts in zip(requests, drafts, strict=True):
            walk = _DraftWalk(request.structured_output_request)
            for i in range(len(request_drafts) + 1):
                if walk.thinking or walk.matcher.is_terminated():
                    # Thinking: every token allowed. Terminated (a draft was its stop token):
                    # the request ends there and this row's token is dropped.
                    bitmask[row] = -1
                else:
                    walk.matcher.fill_next_token_bitmask(bitmask, row)
                if i < len(request_drafts):
                    accepted = walk.accept(request_drafts[i])
                    assert accepted, (request.request_id, request_drafts)  # valid_drafts' check
                row += 1
            walk.rollback()
        return bitmask.numpy()

    def valid_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the request's grammar accepts after its output so far
        (while it thinks, the drafts up to the reasoning end token are free); the matcher is
        left as it was."""
        walk = _DraftWalk(request.structured_output_request)
        num_valid = 0
        while num_valid < len(drafts) and walk.accept(drafts[num_valid]):
            num_valid += 1
        walk.rollback()
        return drafts[:num_valid]

    def accept_token(self, request: Request, token_id: int) -> RequestStatus | None:
        """Advances the request's matcher over its sampled token. Returns the status that ends
        the request (FINISHED_STOPPED: the grammar terminated; FINISHED_ERROR: the grammar
        rejected a token the bitmask allowed, possible only when another mask left no token),
        or None: it goes on."""
        so_request = request.structured_output_request
        if so_request.reasoning_end_token_id is not None:  # thinking: the grammar waits
            if token_id == so_request.reasoning_end_token_id:
                so_request.reasoning_end_token_id = None
            return None
        matcher = so_request.matcher
        if not matcher.accept_token(token_id):
            logger.error(
                "request %s: token %d does not fit its grammar; finishing it",
                request.request_id,
                token_id,
            )
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if matcher.is_terminated() else None

    def shutdown(self) -> None:
        if self._backend is not None:
            self._backend.shutdown()


class _DraftWalk:
    """A request's grammar stepped over drafted tokens, then rolled back: the matcher accepts
    each draft once the thinking (if any) has ended with its end token."""

    def __init__(self, so_request: StructuredOutputRequest) -> None:
        self.matcher = so_request.matcher
        self.thinking = so_request.reasoning_end_token_id is not None
        self.end_token_id = so_request.reasoning_end_token_id
        self.num_accepted = 0  # tokens the matcher took, to roll back

    def accept(self, token_id: int) -> bool:
        """Whether the grammar takes `token_id` next (the matcher advances if so)."""
        if self.thinking:
            self.thinking = token_id != self.end_token_id
            return True
        if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    def rollback(self) -> None:
        if self.num_accepted:
            self.matcher.rollback(self.num_accepted)
        self.num_accepted = 0
