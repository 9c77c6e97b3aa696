"""vLLM's sampling fields end to end through `LLM` (and once through `AsyncLLM` over the socket):
logit_bias, allowed_token_ids, bad_words, min_tokens, skip_special_tokens and
truncate_prompt_tokens change what is generated, detokenize=False only drops the text; invalid
values name the field. And `LLM.chat`'s
template options (vLLM's keywords) reach the template, and `generation_config` gives the
sampling defaults.

A random 2-layer llama with SmolLM2's tokenizer, so bad words and special tokens are real text.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from tests.entrypoints.llm_utils import make_llm
from tests.entrypoints.openai.server_utils import make_tiny_checkpoint
from tests.timeouts import scaled
from v1engine.engine.async_llm import AsyncLLM
from v1engine.engine.core_client import EngineCoreClient
from v1engine.engine.metrics import ServerMetrics
from v1engine.engine.processor import bad_words_token_ids
from v1engine.engine_args import EngineArgs
from v1engine.entrypoints.llm import LLM
from v1engine.sampling_params import SamplingParams

_ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20)
PROMPT = "The quick brown fox jumps over the lazy dog and then"
# One token each, with a leading space, in SmolLM2's vocabulary.
WORDS = (" red", " green", " blue")


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, **kwargs})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(checkpoint, **_ENGINE_ARGS) as llm:
        yield llm


def generate(llm: LLM, params: SamplingParams, prompt=PROMPT):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def contains(tokens: list[int], sequence: list[int]) -> bool:
    n = len(sequence)
    return any(tokens[i : i + n] == sequence for i in range(len(tokens) - n + 1))


def test_logit_bias_forces_a_token(llm):
    plain = generate(llm, greedy()).token_ids
    forced = next(t for t in range(1000, 2000) if t not in plain)
    assert generate(llm, greedy(logit_bias={forced: 100.0})).token_ids == [forced] * 12
    # A ban on the greedy first token moves the first choice elsewhere.
    banned = generate(llm, greedy(logit_bias={plain[0]: -100.0})).token_ids
    assert banned[0] != plain[0]


def test_allowed_token_ids_restrict_every_token(llm):
    allowed = [300, 301, 5000, 7000]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=0, allowed_token_ids=allowed)
    tokens = generate(llm, params).token_ids
    assert len(tokens) == 24 and set(tokens) <= set(allowed) and len(set(tokens)) > 1


def _round_trips(tokenizer, token_ids: list[int]) -> bool:
    text = tokenizer.decode(token_ids)
    return text.strip().isalpha() and tokenizer.encode(text, add_special_tokens=False) == token_ids


def test_bad_words_never_appear(llm, tokenizer):
    plain = generate(llm, greedy(max_tokens=16)).token_ids
    # A one-token word and a two-token one, both spelled exactly as greedy spells them.
    single = next(plain[i : i + 1] for i in range(16) if _round_trips(tokenizer, plain[i : i + 1]))
    double = next(plain[i : i + 2] for i in range(15) if _round_trips(tokenizer, plain[i : i + 2]))
    for word_ids in (single, double):
        word = tokenizer.decode(word_ids)
        assert word_ids in bad_words_token_ids(tokenizer, [word])
        tokens = generate(llm, greedy(max_tokens=16, bad_words=[word])).token_ids
        assert contains(plain, word_ids) and not contains(tokens, word_ids), word
        for sequence in bad_words_token_ids(tokenizer, [word]):
            assert not contains(tokens, sequence)


def test_min_tokens_holds_off_eos_and_stop_tokens(llm, tokenizer):
    eos = tokenizer.eos_token_id
    # A +100 bias makes EOS the greedy choice at every step.
    eager = greedy(ignore_eos=False, logit_bias={eos: 100.0})
    assert generate(llm, eager).token_ids == [eos]
    output = generate(llm, greedy(ignore_eos=False, logit_bias={eos: 100.0}, min_tokens=5))
    assert output.token_ids[5:] == [eos] and eos not in output.token_ids[:5]
    assert output.finish_reason == "stop"
    stop_token = generate(llm, greedy()).token_ids[1]
    output = generate(llm, greedy(stop_token_ids=[stop_token], min_tokens=6))
    assert len(output.token_ids) >= 6 and stop_token not in output.token_ids[:6]


def test_min_tokens_holds_off_stop_strings(llm, tokenizer):
    word_id = tokenizer.encode(" fox", add_special_tokens=False)
    forced = greedy(logit_bias={word_id[0]: 100.0}, stop=["fox"])
    assert generate(llm, forced).text == " "
    output = generate(llm, greedy(logit_bias={word_id[0]: 100.0}, stop=["fox"], min_tokens=3))
    assert output.text == " fox fox " and output.finish_reason == "stop"


def test_skip_special_tokens_false_keeps_their_text(llm, tokenizer):
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = dict(max_tokens=3, logit_bias={im_start: 100.0})
    assert generate(llm, greedy(**forced)).text == ""
    kept = generate(llm, greedy(**forced, skip_special_tokens=False))
    assert kept.text == "<|im_start|>" * 3
    spaced = greedy(**forced, skip_special_tokens=False, spaces_between_special_tokens=False)
    # A fast tokenizer joins special tokens without spaces either way (as in vLLM).
    assert generate(llm, spaced).text == kept.text


def test_detokenize_false_gives_the_same_tokens_without_text(llm):
    asked = dict(logprobs=2, prompt_logprobs=1)
    text = llm.generate([PROMPT], greedy(**asked), use_tqdm=False)[0]
    ids = llm.generate([PROMPT], greedy(**asked, detokenize=False), use_tqdm=False)[0]
    assert ids.outputs[0].token_ids == text.outputs[0].token_ids
    assert text.outputs[0].text and ids.outputs[0].text == ""
    for output in (ids.outputs[0].logprobs, ids.prompt_logprobs[1:]):
        assert all(lp.decoded_token is None for row in output for lp in row.values())
    assert all(lp.decoded_token for row in text.outputs[0].logprobs for lp in row.values())
    # Logprobs are the same numbers either way.
    assert [row.keys() for row in ids.outputs[0].logprobs] == [
        row.keys() for row in text.outputs[0].logprobs
    ]
    with pytest.raises(ValueError, match="SamplingParams.detokenize must be True with stop"):
        SamplingParams(stop=["."], detokenize=False)


def test_a_cache_salt_in_the_prompt_keeps_the_prefix_cache_to_its_salt(llm):
    tokens = list(range(1000, 1040))  # 2 full blocks and more

    def cached(**salt) -> int:
        prompt = {"prompt_token_ids": tokens, **salt}
        return llm.generate([prompt], greedy(max_tokens=1), use_tqdm=False)[0].num_cached_tokens

    assert cached(cache_salt="a") == 0 and cached(cache_salt="a") > 0
    assert cached(cache_salt="b") == 0 and cached() == 0
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        cached(cache_salt="")
    assert not llm.llm_engine.has_unfinished_requests()


def test_truncate_prompt_tokens_equals_sending_the_truncated_prompt(llm, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    truncated = llm.generate([PROMPT], greedy(truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert truncated.prompt_token_ids == prompt_ids[-4:]
    assert truncated.outputs[0].token_ids == generate(llm, greedy(), prompt_ids[-4:]).token_ids
    assert generate(llm, greedy(), prompt_ids).token_ids != truncated.outputs[0].token_ids
    whole = llm.generate([prompt_ids], greedy(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == prompt_ids


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(logit_bias={49152: 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[5, 10**6]), "allowed_token_ids"),
    ],
)
def test_token_ids_outside_the_vocabulary_name_the_field(llm, params, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}.*outside the vocabulary"):
        generate(llm, SamplingParams(**params))
    assert not llm.llm_engine.has_unfinished_requests()
    assert generate(llm, greedy(max_tokens=2)).token_ids


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={5: -101}), "logit_bias"),
        (dict(logit_bias={"five": 1.0}), "logit_bias"),
        (dict(min_tokens=17, max_tokens=16), "min_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ],
)
def test_invalid_values_name_the_field(params, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**params)


def test_async_llm_carries_the_fields_over_the_socket(checkpoint, tokenizer):
    config = EngineArgs.from_kwargs(model=checkpoint, **_ENGINE_ARGS).create_engine_config()
    prompt_ids = tokenizer.encode(PROMPT)
    eos = tokenizer.eos_token_id
    red, green, blue = (tokenizer.encode(w, add_special_tokens=False)[0] for w in WORDS)
    params = greedy(
        ignore_eos=False,
        logit_bias={eos: 100.0},
        min_tokens=4,
        allowed_token_ids=[eos, red, green, blue],
        bad_words=["green"],
        truncate_prompt_tokens=5,
    )

    async def main():
        client = EngineCoreClient.make_client(config, multiprocess=True, asyncio_mode=True)
        metrics = ServerMetrics("tiny", config.scheduler_config.max_model_len)
        engine = AsyncLLM(client, tokenizer, config, metrics)
        engine.start()
        try:
            outputs = await engine.add_request("a", PROMPT, prompt_ids, params, "final")
            return await asyncio.wait_for(_last(outputs), scaled(60))
        finally:
            await engine.stop()
            client.shutdown()

    final = asyncio.run(main())
    assert final.prompt_token_ids == prompt_ids[-5:]
    tokens = final.outputs[0].token_ids
    assert tokens[4:] == [eos] and set(tokens[:4]) <= {red, blue}


async def _last(outputs):
    async for output in outputs:
        last = output
    return last


def test_bad_words_without_a_tokenizer_are_refused(checkpoint):
    with make_llm(checkpoint, tensor_parallel_size=1) as llm:
        with pytest.raises(ValueError, match="bad_words need a tokenizer"):
            llm.generate([[5, 6]], greedy(bad_words=["fox"]), use_tqdm=False)
        # Token-id fields need none.
        output = llm.generate([[5, 6]], greedy(max_tokens=3, logit_bias={7: 100.0}), use_tqdm=False)
        assert output[0].outputs[0].token_ids == [7, 7, 7]


def test_chat_takes_vllms_template_options(llm) -> None:
    conversation = [{"role": "user", "content": "Tell me a story"}]
    params = greedy(max_tokens=2)
    [plain] = llm.chat(conversation, params, use_tqdm=False)
    assert plain.prompt.endswith("Tell me a story<|im_end|>\n<|im_start|>assistant\n")
    partial = [*conversation, {"role": "assistant", "content": "Once upon a"}]
    [continued] = llm.chat(
        partial, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert continued.prompt.endswith("<|im_start|>assistant\nOnce upon a")
    template = "{{ persona }}:{% for m in messages %} {{ m.content }}{% endfor %}"
    [templated] = llm.chat(
        [conversation, partial],  # a list of conversations, one output each
        params,
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs={"persona": "pirate"},
    )[1:]
    assert templated.prompt == "pirate: Tell me a story Once upon a"
    assert len(templated.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="cannot apply the chat template.*continue_final_message"):
        llm.chat(partial, params, use_tqdm=False, continue_final_message=True)


def test_generate_without_params_takes_the_generation_configs_defaults(checkpoint, tmp_path):
    # A greedy default and a cap of 4 tokens, from a folder given as generation_config.
    values = {"temperature": 0.0, "max_new_tokens": 4}
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    with LLM(checkpoint, generation_config=str(tmp_path), **_ENGINE_ARGS) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=4)
        [plain] = llm.generate([PROMPT], use_tqdm=False)
        [greedy4] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4), False)
        assert plain.outputs[0].token_ids == greedy4.outputs[0].token_ids
        [again] = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
        assert len(again.outputs[0].token_ids) <= 4
