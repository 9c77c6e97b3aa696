"""BeamSearch, model-free: which extensions survive a step, how EOS ends a beam, how length_penalty
and the context bound rank and end sequences, and what the API's output holds."""

from __future__ import annotations

import math

from v1engine.engine.beam_search import BeamSearch, step_params
from v1engine.outputs import Logprob
from v1engine.sampling_params import BeamSearchParams

EOS = 0
PROMPT = [7, 8]


def _options(**logprobs: float) -> dict[int, Logprob]:
    # Token ids as keyword names: t5=-0.1 is token 5 with logprob -0.1.
    return {int(name[1:]): Logprob(value) for name, value in logprobs.items()}


def _search(width: int = 2, max_tokens: int = 4, max_model_len: int = 64, **kwargs) -> BeamSearch:
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, **kwargs)
    return BeamSearch(PROMPT, params, EOS, max_model_len)


def test_each_step_asks_for_one_token_and_twice_the_width_in_candidates():
    params = step_params(BeamSearchParams(beam_width=3, max_tokens=9, temperature=0.5))
    assert (params.max_tokens, params.logprobs, params.temperature) == (1, 6, 0.5)


def test_the_best_extensions_of_all_beams_survive():
    search = _search(width=2)
    search.advance([_options(t5=-0.1, t6=-1.0, t9=-3.0)])
    assert search.prompts() == [PROMPT + [5], PROMPT + [6]]
    # Beam [5] extends worse than beam [6] does: both survivors come from [6].
    search.advance([_options(t1=-5.0, t2=-6.0), _options(t3=-0.2, t4=-0.3)])
    assert search.prompts() == [PROMPT + [6, 3], PROMPT + [6, 4]]
    assert [b.cum_logprob for b in search.beams] == [-1.2, -1.3]
    assert search.num_steps == 2 and not search.done


def test_eos_completes_a_beam_and_is_kept_only_if_asked():
    for keep in (False, True):
        search = _search(width=2, max_tokens=2, include_stop_str_in_output=keep)
        search.advance([_options(t0=-0.05, t5=-0.5, t6=-0.7)])
        assert search.prompts() == [PROMPT + [5], PROMPT + [6]]  # EOS is not a live beam
        search.advance([_options(t3=-2.0), _options(t4=-2.0)])
        assert search.done
        best = search.best()
        assert [s.finish_reason for s in best] == ["stop", "length"]
        assert best[0].tokens == PROMPT + [EOS] * keep
        assert best[0].cum_logprob == -0.05


def test_the_score_divides_by_length_to_the_penalty_not_counting_eos():
    # A: prompt + EOS, logprob -1.2, length 2 (EOS not counted). B: prompt + 2 tokens, -1.8,
    # length 4. Plain logprob prefers A; per token (-0.6 vs -0.45), B; at length_penalty 0 only
    # the sum counts.
    for penalty, generated in ((1.0, [5, 6]), (0.0, [])):  # [] is A: its EOS is dropped
        search = _search(width=1, max_tokens=2, length_penalty=penalty, ignore_eos=False)
        search.advance([_options(t0=-1.2, t5=-0.9)])
        search.advance([_options(t6=-0.9)])
        assert search.best()[0].tokens[len(PROMPT) :] == generated


def test_ignore_eos_makes_eos_an_ordinary_token():
    search = _search(width=1, ignore_eos=True)
    search.advance([_options(t0=-0.1, t5=-0.5)])
    assert search.prompts() == [PROMPT + [EOS]]


def test_a_beam_that_fills_the_context_ends_with_length():
    search = _search(width=2, max_tokens=10, max_model_len=len(PROMPT) + 1)
    search.advance([_options(t5=-0.1, t6=-0.2)])
    assert search.done and not search.beams
    assert [s.finish_reason for s in search.best()] == ["length", "length"]


def test_banned_tokens_never_become_beams():
    search = _search(width=2)
    search.advance([_options(t5=-0.1, t6=-math.inf)])
    assert search.prompts() == [PROMPT + [5]]


def test_the_api_output_holds_the_generated_part_best_first():
    search = _search(width=2, max_tokens=1)
    search.advance([_options(t5=-0.5, t6=-0.1)])
    output = search.request_output("req", "text", lambda ids: f"<{ids}>", num_cached_tokens=1)
    assert output.finished and output.prompt_token_ids == PROMPT and output.num_cached_tokens == 1
    got = [(c.index, c.token_ids, c.text, c.cumulative_logprob) for c in output.outputs]
    assert got == [(0, [6], "<[6]>", -0.1), (1, [5], "<[5]>", -0.5)]
    assert search.output(None).sequences[0].tokens == PROMPT + [6]
