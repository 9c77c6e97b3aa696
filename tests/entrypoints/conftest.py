"""Fixtures shared by the LLM tests."""

from __future__ import annotations

import pytest

from tests.model.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory) -> str:
    """A tiny random llama without tokenizer files (prompts are token ids)."""
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
