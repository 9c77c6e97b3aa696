"""GGUF -> cached safetensors conversion: once, atomically, and (slow) SmolLM2 parity."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tests.model.paged_runner import generate_paged, hf_reference
from tests.model.test_hf_config import _smollm2_path
from v1engine.model import gguf_conversion
from v1engine.model.hf_config import load_hf_config, prepare_checkpoint
from v1engine.model.loader import load_model


def _fake_gguf(tmp_path) -> str:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


def _counting_convert(calls: list[str]):
    def convert(gguf_path: str, out_dir: str) -> None:
        calls.append(out_dir)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")

    return convert


def test_conversion_runs_once_and_is_reused(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(gguf_conversion, "_convert", _counting_convert(calls))
    gguf = _fake_gguf(tmp_path)
    cache = str(tmp_path / "cache")
    threads = [threading.Thread(target=prepare_checkpoint, args=(gguf, cache)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    target = prepare_checkpoint(gguf, cache)
    assert len(calls) == 1
    assert os.path.basename(target).startswith("tiny-")
    assert os.path.isfile(os.path.join(target, "config.json"))
    # Only the finished directory, its lock and the file's digest remain: the temporary
    # directory was renamed.
    name = os.path.basename(target)
    assert sorted(os.listdir(cache)) == sorted([name, f"{name}.lock", "digests"])


def test_copies_of_one_file_share_a_conversion(tmp_path, monkeypatch):
    # The default model's wheel, installed in a new virtual environment, is not converted again.
    calls: list[str] = []
    monkeypatch.setattr(gguf_conversion, "_convert", _counting_convert(calls))
    gguf = _fake_gguf(tmp_path)
    copy = tmp_path / "venv2" / "tiny.gguf"
    copy.parent.mkdir()
    copy.write_bytes(b"GGUF")
    cache = str(tmp_path / "cache")
    assert prepare_checkpoint(gguf, cache) == prepare_checkpoint(str(copy), cache)
    assert len(calls) == 1


def test_changed_file_gets_a_new_conversion(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(gguf_conversion, "_convert", _counting_convert(calls))
    gguf = _fake_gguf(tmp_path)
    first = prepare_checkpoint(gguf, str(tmp_path))
    with open(gguf, "ab") as f:
        f.write(b"more")
    second = prepare_checkpoint(gguf, str(tmp_path))
    assert first != second and len(calls) == 2


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(gguf_path: str, out_dir: str) -> None:
        raise RuntimeError("corrupt file")

    monkeypatch.setattr(gguf_conversion, "_convert", broken)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="corrupt file"):
        prepare_checkpoint(_fake_gguf(tmp_path), str(cache))
    left = [name for name in os.listdir(cache) if not name.endswith(".lock")]
    assert left == ["digests"]  # the file's digest only; no checkpoint, no temporary directory


@pytest.mark.slow
def test_smollm2_conversion_matches_transformers():
    """The real default model: dequantized once, then our paged run against transformers. The
    conversion is the shared cache's (made here, or by the first test that needed the default
    model): a second one would only repeat the same 20 s of transformers' GGUF reading, and the
    cache's own mechanics are tested above."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prepare_checkpoint(_smollm2_path())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))
    hf_config = load_hf_config(path)
    assert hf_config.architectures == ["LlamaForCausalLM"] and hf_config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(text)["input_ids"] for text in ("The capital of France is", "1, 2, 3,")]
    model = load_model(path, hf_config, torch.float32, "cpu")
    outputs, logits = generate_paged(model, prompts, max_new_tokens=4, token_budget=8)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, generated, ours in zip(prompts, outputs, logits):
        expected = hf_reference(hf_model, prompt, generated)
        # 30 layers in float32: observed error ~5e-5.
        torch.testing.assert_close(ours, expected, atol=2e-4, rtol=0)
        assert generated == expected[len(prompt) - 1 :].argmax(-1).tolist()
