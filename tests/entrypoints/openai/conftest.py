"""Fixtures shared by the server tests: the tiny checkpoint (with SmolLM2's tokenizer)."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.server_utils import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_model")))
