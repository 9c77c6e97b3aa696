"""The scheduler with a real StructuredOutputManager (real xgrammar, SmolLM2's real tokenizer) and
the fake worker: requests wait for their grammar without holding up the queue, only structured
requests that sample get a bitmask row (none for a partial prefill chunk), matchers survive
preemption, a terminated grammar stops its request, a failed or slow compile ends it with "error",
drafts are checked against the grammar and get a bitmask row each.

The "model" samples a random token among those its bitmask row allows, so what comes out must
fit the grammar whatever the chunking and preemption did.
"""

from __future__ import annotations

import random
import re
import threading

import numpy as np
import pytest
from transformers import AutoTokenizer

from tests.core.fake_worker import (
    FakeWorker,
    make_kv_cache_config,
    make_request,
    make_worker,
    step,
)
from v1engine.config import CacheConfig, ModelConfig, SchedulerConfig
from v1engine.core.scheduler import Scheduler
from v1engine.core.structured_output_manager import StructuredOutputManager
from v1engine.core_protocol import EngineCoreInfo
from v1engine.model.hf_config import default_model_path, prepare_checkpoint
from v1engine.outputs import ModelRunnerOutput
from v1engine.request import EngineCoreRequest, FinishReason, RequestStatus, validate_request
from v1engine.sampling_params import SamplingParams
from v1engine.structured_outputs import StructuredOutputsParams

REGEX = r"[a-c]{2,5}-[0-9]{1,3}"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare_checkpoint(default_model_path()))


def make_structured_scheduler(tokenizer, key: str = "smollm2", load=None, timeout_s=30.0, **kw):
    manager = StructuredOutputManager(
        ModelConfig(model=key), len(tokenizer), timeout_s, load or (lambda: tokenizer)
    )
    num_blocks = kw.pop("num_blocks", 64)
    scheduler = Scheduler(
        SchedulerConfig(128, kw.pop("max_num_batched_tokens", 64), 16),
        CacheConfig(block_size=4),
        make_kv_cache_config(num_blocks, 4),
        manager,
    )
    return scheduler, manager


def regex_request(request_id: str, prompt: list[int], **kwargs):
    kwargs.setdefault("max_tokens", 40)
    return make_request(
        request_id, prompt, structured_outputs=StructuredOutputsParams(regex=REGEX), **kwargs
    )


class GrammarWorker(FakeWorker):
    """The fake worker, but a structured request's token is drawn from its bitmask row
    (`rng`, `bitmask_rows`: set by `grammar_worker`)."""

    def pick_tokens(self, scheduler_output, req_ids, sampled):
        rows = scheduler_output.structured_output_request_ids
        self.bitmask_rows.append(rows)
        for i, req_id in enumerate(req_ids):
            if req_id in rows:
                assert sampled[i], "a bitmask row for a request not sampling"
                words = scheduler_output.grammar_bitmask[rows[req_id]]
                allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
                sampled[i] = [self.rng.choice(allowed.tolist())]
        return sampled


def grammar_worker(scheduler: Scheduler, seed: int = 0) -> GrammarWorker:
    worker = make_worker(scheduler, worker_cls=GrammarWorker)
    worker.rng = random.Random(seed)
    worker.bitmask_rows = []
    return worker


def run(scheduler, worker, max_steps=400) -> dict[str, tuple[list[int], str]]:
    results: dict[str, tuple[list[int], str]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return results
        _, outputs = step(scheduler, worker)
        for req_id, out in outputs.items():
            tokens = results.get(req_id, ([], ""))[0] + out.new_token_ids
            results[req_id] = (tokens, str(out.finish_reason))
    raise AssertionError("did not finish")


def test_waiting_grammar_does_not_hold_up_the_queue(tokenizer) -> None:
    release = threading.Event()
    # A fresh tokenizer key: the compile must build its compiler, which waits for `release`.
    scheduler, manager = make_structured_scheduler(
        tokenizer, key="held", load=lambda: release.wait(60) and tokenizer
    )
    worker = grammar_worker(scheduler)
    scheduler.add_request(regex_request("structured", [5, 6, 7]))
    scheduler.add_request(make_request("plain", [8, 9], max_tokens=3, ignore_eos=True))
    output, _ = step(scheduler, worker)
    assert list(output.num_scheduled_tokens) == ["plain"]
    assert scheduler.requests["structured"].status == RequestStatus.WAITING_FOR_FSM
    assert [r.request_id for r in scheduler.waiting] == ["structured"]
    release.set()
    manager.wait_for_grammars(scheduler.waiting, 60)
    results = run(scheduler, worker)
    tokens, reason = results["structured"]
    assert re.fullmatch(REGEX, tokenizer.decode(tokens, skip_special_tokens=True)), tokens
    assert reason == "stop" and results["plain"][1] == "length"
    manager.shutdown()


def test_chunked_prefill_and_preemption_keep_outputs_in_the_grammar(tokenizer) -> None:
    # 12 usable blocks of 4 tokens and an 8-token budget: long prompts are chunked, and the
    # requests outgrow the pool, so some are preempted and recomputed.
    scheduler, manager = make_structured_scheduler(
        tokenizer, num_blocks=13, max_num_batched_tokens=8
    )
    worker = grammar_worker(scheduler, seed=3)
    for i in range(4):
        scheduler.add_request(regex_request(f"s{i}", list(range(20 + i, 33 + i)), ignore_eos=True))
        scheduler.add_request(make_request(f"p{i}", [40 + i] * 6, max_tokens=10, ignore_eos=True))
    manager.wait_for_grammars(scheduler.waiting, 60)
    results = run(scheduler, worker)
    assert scheduler.num_preemptions > 0
    for i in range(4):
        tokens, reason = results[f"s{i}"]
        # ignore_eos: the grammar's stop token is accepted and ends the request with "stop".
        assert reason == "stop" and tokens[-1] == tokenizer.eos_token_id
        text = tokenizer.decode(tokens[:-1], skip_special_tokens=True)
        assert re.fullmatch(REGEX, text), text
    assert any(rows for rows in worker.bitmask_rows)
    manager.shutdown()


@pytest.mark.parametrize("bad", [dict(grammar="root ::= "), dict(json='{"type": "objekt"}')])
def test_a_grammar_that_fails_to_compile_ends_its_request_with_error(tokenizer, bad) -> None:
    scheduler, manager = make_structured_scheduler(tokenizer)
    worker = grammar_worker(scheduler)
    request = make_request("bad", [1, 2], structured_outputs=StructuredOutputsParams(**bad))
    scheduler.add_request(request)
    scheduler.add_request(make_request("ok", [3, 4], max_tokens=2, ignore_eos=True))
    manager.wait_for_grammars(scheduler.waiting, 60)
    results = run(scheduler, worker)
    assert results["bad"] == ([], str(FinishReason.ERROR))
    assert results["ok"][1] == "length" and not scheduler.requests
    manager.shutdown()


def test_a_compile_past_the_time_out_ends_its_request_with_error(tokenizer) -> None:
    release = threading.Event()
    scheduler, manager = make_structured_scheduler(
        tokenizer, key="slow", load=lambda: release.wait(60) and tokenizer, timeout_s=0.0
    )
    scheduler.add_request(regex_request("slow", [1, 2]))
    try:
        results = run(scheduler, grammar_worker(scheduler))
    finally:
        release.set()
        manager.shutdown()
    assert results["slow"] == ([], "error")


class ThinkingWorker(GrammarWorker):
    """Thinks first: while a request's bitmask row allows every token, it samples `thoughts`,
    then the reasoning end token; after that, from its bitmask row as GrammarWorker does."""

    def pick_tokens(self, scheduler_output, req_ids, sampled):
        sampled = super().pick_tokens(scheduler_output, req_ids, sampled)
        rows = scheduler_output.structured_output_request_ids
        for i, req_id in enumerate(req_ids):
            if req_id in rows and (scheduler_output.grammar_bitmask[rows[req_id]] == -1).all():
                self.free_rows += 1
                sampled[i] = [self.thoughts.pop(0) if self.thoughts else THINK_END_ID]
        return sampled


THINK_END_ID = 1234


def test_a_request_thinks_freely_then_follows_its_grammar(tokenizer) -> None:
    scheduler, manager = make_structured_scheduler(tokenizer)
    worker = make_worker(scheduler, worker_cls=ThinkingWorker)
    worker.rng, worker.bitmask_rows, worker.free_rows = random.Random(0), [], 0
    thoughts = [tokenizer.encode(w)[0] for w in ("Let", " me", " think")]
    worker.thoughts = list(thoughts)
    params = StructuredOutputsParams(regex=REGEX, _reasoning_end_token_id=THINK_END_ID)
    scheduler.add_request(make_request("r", [5, 6, 7], max_tokens=40, structured_outputs=params))
    manager.wait_for_grammars(scheduler.waiting, 60)
    tokens, reason = run(scheduler, worker)["r"]
    # Every row before the end token allowed everything (no grammar would allow "Let me").
    assert tokens[: len(thoughts) + 1] == [*thoughts, THINK_END_ID]
    assert worker.free_rows == len(thoughts) + 1
    answer = tokenizer.decode(tokens[len(thoughts) + 1 :], skip_special_tokens=True)
    assert reason == "stop" and re.fullmatch(REGEX, answer), answer
    manager.shutdown()


def test_a_reasoning_end_token_outside_the_vocabulary_is_refused() -> None:
    structured = StructuredOutputsParams(regex=REGEX, _reasoning_end_token_id=10**6)
    request = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=structured))
    with pytest.raises(ValueError, match=r"structured_outputs has token ids \[1000000\]"):
        validate_request(request, EngineCoreInfo(0, 16, 128, 49152), set())


def _allowed(bitmask_row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")))


def test_drafts_are_kept_up_to_the_first_the_grammar_rejects_with_a_bitmask_row_each(
    tokenizer,
) -> None:
    """Speculative decoding with a grammar: the drafts after the first the regex rejects are
    dropped; the step carries a bitmask row for the last known token and each draft, each what
    the grammar allows after the drafts before it; the matcher is left as it was."""
    scheduler, manager = make_structured_scheduler(tokenizer)
    a, b, c, dash, x, one = tokenizer.convert_tokens_to_ids(["a", "b", "c", "-", "x", "1"])
    request = regex_request("r", [5, 6, 7], ignore_eos=True)
    scheduler.add_request(request)
    manager.wait_for_grammars(scheduler.waiting, 60)
    out = scheduler.schedule()
    reply = ModelRunnerOutput(["r"], [[a]], spec_token_ids=[[b, c, dash, x, one]])
    scheduler.update_from_output(out, reply)
    assert request.spec_token_ids == [b, c, dash]  # "x" cannot follow "abc-"

    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"r": [b, c, dash]}
    assert out.structured_output_request_ids == {"r": 0} and len(out.grammar_bitmask) == 4
    rows = [_allowed(row) for row in out.grammar_bitmask]
    assert dash not in rows[0] and b in rows[0]  # "a" alone: two letters at least
    assert dash in rows[1] and dash in rows[2]  # "ab", "abc"
    assert one in rows[3] and a not in rows[3]  # "abc-": digits only
    matcher = request.structured_output_request.matcher
    assert matcher.accept_token(dash) is False and matcher.accept_token(b)  # still after "a"
    matcher.rollback(1)

    # The model agreed with "b", then sampled "-" where "c" was drafted.
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[b, dash]]))
    assert outputs.outputs[0].new_token_ids == [b, dash]
    assert matcher.accept_token(one)  # the matcher followed "ab-"
    manager.shutdown()


def test_drafts_of_a_thinking_request_are_free_up_to_the_end_token(tokenizer) -> None:
    scheduler, manager = make_structured_scheduler(tokenizer)
    a, b, dash, x = tokenizer.convert_tokens_to_ids(["a", "b", "-", "x"])
    params = StructuredOutputsParams(regex=REGEX, _reasoning_end_token_id=THINK_END_ID)
    request = make_request("r", [5, 6, 7], max_tokens=40, structured_outputs=params)
    scheduler.add_request(request)
    manager.wait_for_grammars(scheduler.waiting, 60)
    out = scheduler.schedule()
    drafts = [x, THINK_END_ID, a, b, dash, x]
    scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[x]], spec_token_ids=[drafts]))
    assert request.spec_token_ids == drafts[:5]  # "x" cannot follow "ab-"
    rows = [_allowed(row) for row in scheduler.schedule().grammar_bitmask]
    assert len(rows) == 6 and len(rows[0]) == len(rows[1]) == len(tokenizer)  # thinking
    assert x in rows[1] and x not in rows[2] and dash not in rows[3] and dash in rows[4]
    assert request.structured_output_request.reasoning_end_token_id == THINK_END_ID
    manager.shutdown()
