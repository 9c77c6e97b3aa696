"""`python -m v1engine.serve`'s command line in vLLM's forms: `serve MODEL`, `-tp`, and `--config
FILE` (a YAML mapping of flags, which the command line overrides)."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer, openai_client
from v1engine.serve import parse_args


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_the_model_may_come_first_and_tp_is_short_for_tensor_parallel_size():
    args = parse_args(["/models/smol", "-tp", "2"])
    assert args.model == "/models/smol" and args.tensor_parallel_size == 2
    assert parse_args([]).model is None


def test_two_different_models_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["/models/a", "--model", "/models/b"])
    assert exit_info.value.code == 2
    assert "the model is given twice: /models/a and --model /models/b" in capsys.readouterr().err
    assert parse_args(["/models/a", "--model", "/models/a"]).model == "/models/a"


def test_a_config_file_gives_every_kind_of_flag_and_the_command_line_wins(tmp_path):
    path = _config(
        tmp_path,
        "model: /models/from-file\n"
        "port: 9000\n"
        "max_n: 3\n"  # underscores or dashes
        "enable-lora: true\n"  # --flag/--no-flag
        "enable-prefix-caching: false\n"
        "disable-fastapi-docs: true\n"  # store_true
        "allow-credentials: false\n"
        "served-model-name: [a, b]\n"  # nargs="+"
        "hf-overrides: {max_position_embeddings: 4096}\n",  # a JSON flag
    )
    args = parse_args(["--config", path, "--port", "9100"])
    assert (args.model, args.port, args.max_n) == ("/models/from-file", 9100, 3)
    assert args.enable_lora and not args.enable_prefix_caching
    assert args.disable_fastapi_docs and not args.allow_credentials
    assert args.served_model_name == ["a", "b"]
    assert args.hf_overrides == {"max_position_embeddings": 4096}
    # A positional model is the command line's: it wins over the file's.
    assert parse_args(["/models/cli", "--config", path]).model == "/models/cli"


@pytest.mark.parametrize(
    "text, message",
    [
        ("bogus_flag: 1\n", "'bogus_flag' is not a flag of python -m v1engine.serve"),
        ("config: other.yaml\n", "'config' is not a flag"),
        ("enable-lora: yes please\n", "enable-lora takes true or false, got 'yes please'"),
        ("- port\n", "expected a mapping of flags"),
        ("port: [1\n", "cannot read it as YAML"),
        ("port: eighty\n", "argument --port: invalid int value: 'eighty'"),
    ],
)
def test_a_bad_config_file_is_a_usage_error_naming_the_key(tmp_path, capsys, text, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--config", _config(tmp_path, text)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_config_file_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "nope.yaml")])
    assert "nope.yaml: cannot read it as YAML" in capsys.readouterr().err


def test_a_server_runs_from_a_config_file_and_its_positional_model(tiny_model, tmp_path):
    # The file asks for TP=2; the command line (RemoteServer's --tensor-parallel-size 1) wins.
    path = _config(tmp_path, "served-model-name: [from-file]\nmax-n: 2\ntensor-parallel-size: 2\n")
    remote = RemoteServer(tiny_model, str(tmp_path), tiny_model, "--config", path, tp=1)
    try:
        remote.wait_ready()
        assert len(remote.worker_pids()) == 1
        client = openai_client(remote)
        assert [model.id for model in client.models.list().data] == ["from-file"]
        reply = client.completions.create(model="from-file", prompt="Hi", max_tokens=2, n=2)
        assert len(reply.choices) == 2
        with pytest.raises(openai.BadRequestError, match="over this server.s limit of 2"):
            client.completions.create(model="from-file", prompt="Hi", max_tokens=2, n=3)
        assert remote.stop() == 0, remote.log_text()[-3000:]
        remote.assert_gone()
    finally:
        remote.kill()
