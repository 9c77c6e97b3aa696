"""vLLM's `POST /tokenize` and `POST /detokenize`, and `GET /v1/models/{id}`, against a real
server (tiny random llama with SmolLM2's tokenizer and chat template): the ids are the tokenizer's
own, chat messages are rendered exactly as /v1/chat/completions renders them, and text and chats
round-trip through detokenize. The same server takes its sampling defaults from a
`--generation-config` folder (one value overridden by `--override-generation-config`), and with
--disable-log-stats logs no stats line.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer, serve_module

API_KEY = "test-key"
MODEL = "tiny"
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Tell me a story about a fox."},
]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    # Sampling defaults (top_k 1, at most 7 tokens) from a folder given as --generation-config,
    # whose 9 tokens --override-generation-config lowers to 7.
    generation = tmp_path_factory.mktemp("generation")
    (generation / "generation_config.json").write_text('{"top_k": 1, "max_new_tokens": 9}')
    args = ("--api-key", API_KEY, "--served-model-name", MODEL)
    args += ("--generation-config", str(generation), "--disable-log-stats")
    args += ("--override-generation-config", '{"max_new_tokens": 7}')
    env = {"V1ENGINE_LOG_STATS_INTERVAL": "0.2"}  # were it on, a line every 0.2 s
    yield from serve_module(tiny_model, tmp_path_factory, *args, tp=1, env=env)


def _post(server: RemoteServer, path: str, body: dict) -> httpx.Response:
    # No API key: vLLM's tokenizer endpoints are outside /v1, which is all the key guards.
    return httpx.post(server.url + path, json=body, timeout=60)


@pytest.mark.parametrize("add_special_tokens", [None, True, False])
def test_tokenize_a_prompt(server, tokenizer, add_special_tokens):
    prompt = "The quick brown fox jumps over the lazy dog."
    body = {"model": MODEL, "prompt": prompt}
    if add_special_tokens is not None:
        body["add_special_tokens"] = add_special_tokens
    response = _post(server, "/tokenize", body)
    assert response.status_code == 200, response.text
    expected = tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False)
    assert response.json() == {
        "count": len(expected),
        "max_model_len": 256,
        "tokens": expected,
        "token_strs": None,
    }
    with_strs = _post(server, "/tokenize", {**body, "return_token_strs": True}).json()
    assert with_strs["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    back = _post(server, "/detokenize", {"model": MODEL, "tokens": expected}).json()
    assert back == {"prompt": prompt}


def test_tokenize_a_chat_renders_it_as_chat_completions_does(server, tokenizer):
    response = _post(server, "/tokenize", {"messages": CHAT})
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert tokens == tokenizer.encode(text, add_special_tokens=False)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert reply.usage.prompt_tokens == response.json()["count"]
    back = _post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert back == text
    without = _post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert tokens[: without.json()["count"]] == without.json()["tokens"]
    assert without.json()["count"] < len(tokens)


def test_text_parts_render_as_vllm_joins_them_and_an_image_is_a_400(server, tokenizer):
    # OpenAI's clients may send content as a list of parts; vLLM joins the text-like ones
    # (text, input_text, output_text, an assistant's refusal) with "\n".
    parts = [
        {"type": "text", "text": "Tell me a story"},
        {"type": "input_text", "text": "of a fox."},
    ]
    refusal = [{"type": "refusal", "refusal": "I cannot."}, {"type": "output_text", "text": "Ok."}]
    as_parts = [CHAT[0], {"role": "user", "content": parts}]
    as_parts.append({"role": "assistant", "content": refusal})
    joined = [CHAT[0], {"role": "user", "content": "Tell me a story\nof a fox."}]
    joined.append({"role": "assistant", "content": "I cannot.\nOk."})
    response = _post(server, "/tokenize", {"messages": as_parts})
    assert response.status_code == 200, response.text
    assert response.json() == _post(server, "/tokenize", {"messages": joined}).json()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    chat = [CHAT[0], {"role": "user", "content": [parts[0], image]}]
    response = _post(server, "/tokenize", {"messages": chat})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    message = response.json()["error"]["message"]
    assert message.startswith("messages[1].content[1]: only text content parts (text, ")
    assert message.endswith("are supported, got 'image_url'")


def test_tokenize_continues_the_final_message(server, tokenizer):
    partial = [*CHAT, {"role": "assistant", "content": "Once upon a"}]
    body = {"messages": partial, "add_generation_prompt": False, "continue_final_message": True}
    response = _post(server, "/tokenize", body)
    assert response.status_code == 200, response.text
    text = _post(server, "/detokenize", {"tokens": response.json()["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nOnce upon a")
    both = _post(server, "/tokenize", {**body, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "messages"


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "words"),
    [
        ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "model", "`nope` does not exist"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model", "`nope` does not exist"),
        ("/tokenize", {}, 400, "prompt", "got neither"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt", "got both"),
        ("/tokenize", {"prompt": 5}, 400, "prompt", "prompt"),
        ("/detokenize", {"tokens": [1, -1, 49152]}, 400, "tokens", "[-1, 49152]"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens", "tokens"),
    ],
)
def test_tokenizer_endpoint_errors(server, path, body, status, param, words):
    response = _post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param
    assert words in error["message"]


def test_retrieve_a_model(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_dump()["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError, match="does not exist") as info:
        client.models.retrieve("nope")
    assert info.value.body["code"] == 404 and info.value.body["param"] == "model"
    # Under /v1, so behind the API key (the tokenizer endpoints are not).
    assert httpx.get(server.url + f"/v1/models/{MODEL}").status_code == 401


def test_requests_take_the_generation_configs_defaults(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)

    def complete(**kwargs):
        extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
        return client.completions.create(model=MODEL, prompt="Once", extra_body=extra, **kwargs)

    greedy = complete(temperature=0.0)
    assert greedy.usage.completion_tokens == 7  # completions' default 16, capped
    assert complete(temperature=0.0, max_tokens=3).usage.completion_tokens == 3
    # top_k 1 unless the request sets its own: sampling at temperature 1 is greedy, any seed.
    sampled = {complete(temperature=1.0, seed=seed).choices[0].text for seed in range(3)}
    assert sampled == {greedy.choices[0].text}
    free = {
        complete(temperature=1.0, seed=seed, extra_body={"top_k": 0}).choices[0].text
        for seed in range(3)
    }
    assert len(free) > 1
    assert "generation_config.json: max_tokens=7, top_k=1 (for requests" in server.log_text()


def test_disable_log_stats_keeps_the_stats_line_out(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    client.completions.create(model=MODEL, prompt="Once", max_tokens=7)
    time.sleep(1.0)  # five intervals at which the line would have come
    assert "Avg generation throughput" not in server.log_text()
