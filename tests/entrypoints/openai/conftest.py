"""Fixtures shared by the server tests: the tiny checkpoint and its (SmolLM2's) tokenizer, and a
module's server of it (TP=1, served as "tiny") with its `openai` client. A module that needs
other flags defines its own `server` fixture, which overrides this one."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.server_utils import make_tiny_checkpoint, openai_client, serve_module


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from serve_module(tiny_model, tmp_path_factory, "--served-model-name", "tiny", tp=1)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)
