"""LLM.generate end to end (real worker processes, real weights) against transformers."""

from __future__ import annotations

import io
import json
import random
import re
import shutil

import pytest
from tqdm import tqdm

from tests.entrypoints.llm_utils import (
    GREEDY,
    PREEMPTING,
    PROMPTS,
    SEEDED,
    all_blocks_free,
    hf_greedy,
    make_llm,
    preempted_greedy,
    seeded_alone_and_in_batch,
    token_ids,
)
from tests.model.checkpoints import give_own_config_class, load_hf_model, make_checkpoint
from tests.process_utils import run_script
from v1engine.request import EngineCoreRequest
from v1engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def hf_model(llama_checkpoint):
    return load_hf_model(llama_checkpoint)


@pytest.fixture(scope="module")
def llm_tp2(llama_checkpoint):
    llm = make_llm(llama_checkpoint, tensor_parallel_size=2)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def llm_tp1(llama_checkpoint):
    llm = make_llm(llama_checkpoint, tensor_parallel_size=1)
    yield llm
    llm.shutdown()


def test_greedy_tokens_equal_transformers_at_tp1_and_tp2(llm_tp1, llm_tp2, hf_model):
    expected = hf_greedy(hf_model, PROMPTS, GREEDY.max_tokens)
    for llm in (llm_tp1, llm_tp2):
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        assert all_blocks_free(llm)


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_other_architectures_equal_transformers(tmp_path, arch):
    checkpoint = make_checkpoint(tmp_path, arch)
    with make_llm(checkpoint, tensor_parallel_size=2) as llm:
        got = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert got == hf_greedy(load_hf_model(checkpoint), PROMPTS, GREEDY.max_tokens)


def test_hf_overrides_reach_the_engine_and_its_workers(llama_checkpoint, hf_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    rope = {"rope_theta": 100.0, "rope_type": "default"}
    overrides = {"rope_parameters": rope, "max_position_embeddings": 96}
    with make_llm(
        llama_checkpoint, hf_overrides=overrides, max_model_len=None, tensor_parallel_size=2
    ) as llm:
        assert llm.config.scheduler_config.max_model_len == 96  # the context follows
        got = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    config = AutoConfig.from_pretrained(llama_checkpoint, **overrides)
    overridden = AutoModelForCausalLM.from_pretrained(llama_checkpoint, config=config).eval()
    assert got == hf_greedy(overridden, PROMPTS, GREEDY.max_tokens)
    assert got != hf_greedy(hf_model, PROMPTS, GREEDY.max_tokens)  # the override mattered


def test_trust_remote_code_runs_a_checkpoint_with_its_own_config_class(
    llama_checkpoint, hf_model, tmp_path
):
    checkpoint = give_own_config_class(shutil.copytree(llama_checkpoint, tmp_path / "own"))
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        make_llm(checkpoint)
    with make_llm(checkpoint, trust_remote_code=True) as llm:
        got = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert got == hf_greedy(hf_model, PROMPTS, GREEDY.max_tokens)


def test_priority_needs_its_policy_and_never_changes_the_tokens(llm_tp1, llama_checkpoint):
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        llm_tp1.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[0, 1])
    assert all_blocks_free(llm_tp1)  # the first prompt, added already, was aborted
    expected = token_ids(llm_tp1.generate(PROMPTS, GREEDY, use_tqdm=False))
    with make_llm(llama_checkpoint, scheduling_policy="priority", max_num_seqs=2) as llm:
        last_first = list(range(len(PROMPTS), 0, -1))
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=last_first)
        assert token_ids(outputs) == expected
        with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
            llm.generate(PROMPTS[:2], GREEDY, priority=[1])


def test_preemption_and_chunked_prefill_keep_tokens_exact(llama_checkpoint, hf_model):
    with make_llm(llama_checkpoint, tensor_parallel_size=2, **PREEMPTING) as llm:
        got = preempted_greedy(llm)
    assert got == hf_greedy(hf_model, PROMPTS, GREEDY.max_tokens)


def test_prefix_cache_computes_only_new_tokens(llm_tp1, hf_model):
    prefix = [random.Random(0).randrange(3, 130) for _ in range(64)]
    first = llm_tp1.generate([prefix + [5]], GREEDY, use_tqdm=False)[0]
    second = llm_tp1.generate([prefix + [6, 7]], GREEDY, use_tqdm=False)[0]
    # 64 prefix tokens = 4 full blocks of 16 were cached by the first request.
    assert second.num_cached_tokens == 64
    assert [second.outputs[0].token_ids] == hf_greedy(hf_model, [prefix + [6, 7]], 12)
    assert first.outputs[0].token_ids == hf_greedy(hf_model, [prefix + [5]], 12)[0]
    assert llm_tp1.reset_prefix_cache()
    again = llm_tp1.generate([prefix + [6, 7]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == second.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_across_batches_and_tp(llm_tp1, llm_tp2):
    alone, in_batch = seeded_alone_and_in_batch(llm_tp1)
    on_tp2 = token_ids(llm_tp2.generate([PROMPTS[1], PROMPTS[0]], SEEDED, use_tqdm=False))[1]
    assert alone == in_batch == on_tp2


def test_abort_frees_every_block(llm_tp2):
    core = llm_tp2.engine_core
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(f"abort-{i}", prompt, GREEDY))
    core.step()
    core.step()
    core.abort_requests([f"abort-{i}" for i in range(len(PROMPTS))])
    assert not core.has_unfinished_requests()
    core.step()  # tells the workers to drop the aborted requests
    assert all_blocks_free(llm_tp2)


@pytest.mark.parametrize(
    "request_kwargs, match",
    [
        (dict(prompt_token_ids=[]), "empty"),
        (dict(prompt_token_ids=list(range(3, 131))), "max_model_len"),
        (dict(prompt_token_ids=[1, 99999]), "outside the vocabulary"),
    ],
)
def test_bad_requests_are_rejected_and_change_nothing(llm_tp1, request_kwargs, match):
    core = llm_tp1.engine_core
    request = EngineCoreRequest("bad", sampling_params=GREEDY, **request_kwargs)
    with pytest.raises(ValueError, match=match):
        core.add_request(request)
    assert not core.has_unfinished_requests()
    assert token_ids(llm_tp1.generate([PROMPTS[1]], GREEDY, use_tqdm=False))


def test_a_bad_prompt_is_refused_under_the_callers_request_id(llm_tp1):
    params = SamplingParams(n=2, max_tokens=1)
    with pytest.raises(ValueError, match="outside the vocabulary") as error:
        llm_tp1.generate([[1, 99999]], params, use_tqdm=False)
    assert not re.search(r"'\d+_\d+'", str(error.value))  # an id of one of its n children
    assert token_ids(llm_tp1.generate([PROMPTS[1]], GREEDY, use_tqdm=False))


@pytest.mark.parametrize("key", ["multi_modal_data", "prompt_embeds", "promptt"])
def test_a_prompt_key_that_would_be_ignored_is_refused(llm_tp1, key):
    prompt = {"prompt_token_ids": PROMPTS[1], key: None}
    with pytest.raises(ValueError, match=f"prompt keys \\['{key}'\\] are not served"):
        llm_tp1.generate([PROMPTS[0], prompt], GREEDY, use_tqdm=False)
    assert not llm_tp1.engine_core.has_unfinished_requests()  # the call's first prompt too
    salted = {"prompt_token_ids": PROMPTS[1], "cache_salt": "user-1"}
    assert token_ids(llm_tp1.generate([salted], GREEDY, use_tqdm=False))


def test_a_checkpoint_without_tokenizer_files_fails_with_the_fix_and_stops_its_engine(
    llama_checkpoint,
):
    # The tokenizer loads while the engine starts: its error comes after the engine is up, which
    # must then be shut down again (the leak check of every test sees its workers and queues).
    with pytest.raises(ValueError, match="(?s)cannot load a tokenizer.*skip_tokenizer_init=True"):
        make_llm(llama_checkpoint, skip_tokenizer_init=False)


def test_invalid_sampling_values_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_n_greater_than_one_returns_n_completions(llm_tp1):
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    (output,) = llm_tp1.generate([PROMPTS[0]], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in output.outputs)


def test_use_tqdm_may_be_the_callable_that_makes_the_bar(llm_tp1, hf_model):
    """As vLLM's: e.g. `functools.partial(tqdm, leave=False)`, called with total and desc."""
    bars = []

    def make_bar(**kwargs):
        bars.append((kwargs, tqdm(file=io.StringIO(), **kwargs)))
        return bars[-1][1]

    got = token_ids(llm_tp1.generate(PROMPTS, GREEDY, use_tqdm=make_bar))
    assert got == hf_greedy(hf_model, PROMPTS, GREEDY.max_tokens)
    ((kwargs, bar),) = bars
    assert kwargs == {"total": len(PROMPTS), "desc": "Generating"} and bar.n == len(PROMPTS)
    # vLLM's speed estimate (its values are timings: only their form is checked).
    speeds = re.fullmatch(r"est\. speed input: (\S+) toks/s, output: (\S+) toks/s", bar.postfix)
    assert speeds and float(speeds[1]) > 0 and float(speeds[2]) > 0, bar.postfix


def _num_kv_heads(worker) -> int:
    """Run in each worker as fn(worker): its rank's share of the KV heads."""
    (spec, *_) = worker.get_kv_cache_spec().values()
    return spec.num_kv_heads


def test_collective_rpc_and_get_tokenizer_as_in_vllm(llm_tp2):
    specs = llm_tp2.collective_rpc("get_kv_cache_spec")
    assert len(specs) == 2 and specs[0] == specs[1]
    heads = llm_tp2.collective_rpc(_num_kv_heads)
    assert heads == [next(iter(specs[0].values())).num_kv_heads] * 2
    assert llm_tp2.collective_rpc(_num_kv_heads, unique_reply_rank=1) == heads[1]
    assert llm_tp2.get_tokenizer() is None  # make_llm skips the tokenizer


_INTERRUPTED_GENERATE = """
import json, signal, sys, threading
from tests.entrypoints.llm_utils import GREEDY, PROMPTS, all_blocks_free, make_llm, token_ids
from v1engine.sampling_params import SamplingParams

if __name__ == "__main__":
    # As in a terminal: Python leaves SIGINT ignored when its parent did (a CI job started in
    # the background of a non-interactive shell), and then Ctrl-C would never arrive here.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    worker_cls = "tests.entrypoints.openai.faulty_worker.SlowWorker"
    with make_llm(sys.argv[1], tensor_parallel_size=1, worker_cls=worker_cls) as llm:
        before = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        main = threading.main_thread().ident
        threading.Timer(1.0, signal.pthread_kill, (main, signal.SIGINT)).start()  # as Ctrl-C
        try:
            llm.generate(PROMPTS, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        after = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        left = len(llm.engine_core.scheduler.requests)
        print(json.dumps([interrupted, before == after, all_blocks_free(llm), left]))
"""


def test_generate_interrupted_by_ctrl_c_leaves_the_engine_usable(llama_checkpoint, tmp_path):
    # In a notebook, Ctrl-C in `generate` and then `generate` again is the common case: the
    # interrupted call's requests must be gone and its step (in flight at the worker) not lost.
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED_GENERATE)
    done = run_script(str(script), llama_checkpoint)
    assert json.loads(done.stdout.splitlines()[-1]) == [True, True, True, 0]
