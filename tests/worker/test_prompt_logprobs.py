"""The worker's prompt-logprob rows: which prompt positions a step scores (chunks, preemption, a
request served from the prefix cache by mistake), and the sliced LM-head computation against one
log_softmax over the whole prompt. End to end through `LLM`: tests/entrypoints/
test_llm_prompt_logprobs.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from v1engine.model.layers.linear import ParallelLMHead
from v1engine.outputs import NewRequestData, SchedulerOutput
from v1engine.sampling_params import SamplingParams
from v1engine.worker.prompt_logprobs import compute_prompt_logprobs, plan_prompt_logprobs
from v1engine.worker.request_states import CachedRequestState, InputBatch, RequestStates

VOCAB_SIZE, HIDDEN_SIZE = 131, 16
CPU = torch.device("cpu")


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed))


class _Step:
    """Real RequestStates (which register the requests that ask) fed as the runner feeds them."""

    def __init__(self, prompts: dict[str, tuple[list[int], int | None]]) -> None:
        self.batch = InputBatch(max_num_reqs=4, max_model_len=256, block_sizes=[16])
        self.states = RequestStates(self.batch, CPU)
        self.prompts = {req_id: [int(t) for t in p] for req_id, (p, _) in prompts.items()}
        new_reqs = [
            NewRequestData(
                req_id, self.prompts[req_id], SamplingParams(prompt_logprobs=k), ([],), 0
            )
            for req_id, (_, k) in prompts.items()
        ]
        self.states.update(SchedulerOutput(scheduled_new_reqs=new_reqs))

    def run(self, computed_and_query: dict[str, tuple[int, int]]):
        """Puts each request in the batch with its computed tokens and plans the step."""
        for req_id in list(self.batch.req_ids):
            self.batch.remove_request(req_id)
        for req_id, (num_computed, _) in computed_and_query.items():
            state = CachedRequestState(
                req_id, self.prompts[req_id], SamplingParams(), None, [[]], num_computed
            )
            self.batch.add_request(state)
        query_lens = np.array([q for _, q in computed_and_query.values()], dtype=np.int64)
        if not self.states.prompt_logprobs:  # as the runner: no plan without an asker
            return None
        return plan_prompt_logprobs(self.states.prompt_logprobs, self.batch, query_lens, CPU)


def test_plan_follows_chunks_and_skips_what_a_preempted_request_already_scored():
    step = _Step({"a": (_prompt(30, 0), 3), "b": (_prompt(12, 1), 0), "c": (_prompt(9, 2), None)})
    plan = step.run({"c": (0, 9), "a": (0, 20), "b": (0, 12)})
    # a: positions 0..19 of its first chunk score tokens 1..20; b: 0..10 (11 scores token 11,
    # the sampled row's is 12's first output). c asked for none.
    assert plan.req_ids == ["a", "b"] and plan.num_rows == [20, 11]
    assert plan.num_logprobs == [3, 0]
    assert plan.token_indices.tolist() == list(range(9, 29)) + list(range(29, 40))
    assert plan.next_token_ids.tolist() == step.prompts["a"][1:21] + step.prompts["b"][1:12]
    # a is preempted and recomputed from 0: only positions 20.. are new.
    plan = step.run({"a": (0, 25)})
    assert plan.num_rows == [5] and plan.token_indices.tolist() == list(range(20, 25))
    assert plan.next_token_ids.tolist() == step.prompts["a"][21:26]
    plan = step.run({"a": (25, 5)})
    assert plan.num_rows == [4] and plan.next_token_ids.tolist() == step.prompts["a"][26:30]
    assert step.states.prompt_logprobs == {}  # every request fully scored
    assert step.run({"a": (30, 1)}) is None  # a decode


def test_a_request_started_past_unscored_positions_is_refused():
    step = _Step({"a": (_prompt(40, 3), 2)})
    with pytest.raises(RuntimeError, match=r"'a'.*starts at token 16 with only 0 prompt"):
        step.run({"a": (16, 24)})


def test_one_token_prompt_scores_nothing():
    step = _Step({"a": (_prompt(1, 4), 5)})
    assert step.states.prompt_logprobs == {}
    assert step.run({"a": (0, 1)}) is None


@pytest.mark.parametrize("slice_rows", [1, 7, 256])
def test_slices_match_one_log_softmax_and_stay_small(slice_rows):
    step = _Step({"a": (_prompt(150, 5), 4), "b": (_prompt(60, 6), 1)})
    plan = step.run({"a": (0, 150), "b": (0, 60)})
    lm_head = ParallelLMHead(VOCAB_SIZE, HIDDEN_SIZE)
    lm_head.weight.data.normal_(generator=torch.Generator().manual_seed(7))
    hidden = torch.randn(210, HIDDEN_SIZE, generator=torch.Generator().manual_seed(8))
    rows_per_call = []

    def compute_logits(hidden_states: torch.Tensor) -> torch.Tensor:
        rows_per_call.append(hidden_states.shape[0])
        return lm_head.compute_logits(hidden_states)

    got = compute_prompt_logprobs(compute_logits, hidden, plan, True, slice_rows)
    assert max(rows_per_call) == min(slice_rows, 208) and sum(rows_per_call) == 149 + 59
    reference = torch.log_softmax(lm_head.compute_logits(hidden), dim=-1)  # [210, vocab]
    for req_id, k, offset in (("a", 4, 0), ("b", 1, 150)):
        lists = got[req_id]
        prompt = step.prompts[req_id]
        assert len(lists.token_ids) == len(prompt) - 1
        for p, (ids, logprobs, rank) in enumerate(
            zip(lists.token_ids, lists.logprobs, lists.sampled_token_ranks)
        ):
            row = reference[offset + p]
            top = row.topk(k)
            assert ids == [prompt[p + 1], *top.indices.tolist()]
            expected = [row[prompt[p + 1]].item(), *top.values.tolist()]
            assert logprobs == pytest.approx(expected, abs=1e-5)
            assert rank == 1 + int((row > row[prompt[p + 1]]).sum())


def test_non_driver_ranks_call_the_lm_head_alike_and_return_nothing():
    step = _Step({"a": (_prompt(20, 9), 2)})
    plan = step.run({"a": (0, 20)})
    calls = []
    lm_head = ParallelLMHead(VOCAB_SIZE, HIDDEN_SIZE)

    def compute_logits(hidden_states: torch.Tensor) -> torch.Tensor:
        calls.append(hidden_states.shape[0])
        return lm_head.compute_logits(hidden_states)

    assert (
        compute_prompt_logprobs(compute_logits, torch.zeros(20, HIDDEN_SIZE), plan, False, 8) == {}
    )
    assert calls == [8, 8, 3]


def test_prompt_logprobs_must_be_non_negative_or_minus_one():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=-1).prompt_logprobs == -1  # vLLM's: every token's
    with pytest.raises(ValueError, match=r"SamplingParams.prompt_logprobs must be >= 0, or -1"):
        SamplingParams(prompt_logprobs=-2)


def test_only_askers_are_tracked_and_a_finished_one_is_dropped():
    step = _Step({"a": (_prompt(30, 10), 1), "b": (_prompt(30, 11), None)})
    assert list(step.states.prompt_logprobs) == ["a"]
    step.states.update(SchedulerOutput(finished_req_ids={"a"}))  # aborted mid-prompt
    assert step.states.prompt_logprobs == {}
    assert step.run({"b": (0, 30)}) is None
