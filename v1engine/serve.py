"""`python -m v1engine.serve`: the OpenAI-compatible HTTP server.

    python -m v1engine.serve                                   # the embedded SmolLM2 model
    python -m v1engine.serve --model /path/to/hf_dir --tensor-parallel-size 2 --port 8000
    python -m v1engine.serve /path/to/hf_dir -tp 2 --config serve.yaml   # vLLM's forms

Every `EngineArgs` field is a flag (`--model`, `--tensor-parallel-size`, `--device`, `--dtype`,
`--max-model-len`, `--gpu-memory-utilization`, ...), plus the server's own below and the limits on
what one request may ask (`--max-n`, `--max-logprobs`, `--max-stop-sequences`,
`--max-stop-sequence-chars`, `--max-request-body-bytes`), `--chat-template FILE`,
`--structured-outputs-disable-any-whitespace`, `--enable-auto-tool-choice --tool-call-parser
hermes`, and HTTPS with `--ssl-keyfile KEY --ssl-certfile CERT`. Exits 0 after
SIGINT/SIGTERM, 1 when the engine dies, 2 for bad arguments or a failed start-up.

As `vllm serve`: the model may also come first, without `--model`; `-tp` is
`--tensor-parallel-size`; `--config FILE` reads flags from a YAML mapping (`port: 8000`,
`enable-lora: true`, `served-model-name: [a, b]`), which the command line overrides.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from v1engine.engine_args import EngineArgs
from v1engine.logger import init_logger

# Not __name__: run as `python -m`, this module is "__main__".
logger = init_logger("v1engine.serve")

_UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def make_arg_parser() -> argparse.ArgumentParser:
    # Imported here, not at the top: every process multiprocessing spawns (the engine core, each
    # worker) re-imports this module first, and these pull in fastapi (~0.3 s each).
    from v1engine.entrypoints.openai.limits import RequestLimits
    from v1engine.entrypoints.openai.serving_options import ServingOptions

    parser = argparse.ArgumentParser(
        prog="python -m v1engine.serve",
        description="OpenAI-compatible HTTP server for one node (one worker per device).",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model (vLLM's `vllm serve MODEL`)",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a YAML file of flags (`port: 8000`); the command line overrides it",
    )
    _add_server_args(parser.add_argument_group("server"))
    RequestLimits.add_cli_args(parser.add_argument_group("request limits"))
    ServingOptions.add_cli_args(parser.add_argument_group("serving"))
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))
    return parser


def _add_server_args(server: Any) -> None:
    from v1engine.entrypoints.openai import tls

    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    server.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes"
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use as `model` (default: --model as given)",
    )
    server.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer with an X-Request-Id header: the request's own, else a new id",
    )
    for name in ("origins", "methods", "headers"):
        server.add_argument(
            f"--allowed-{name}",
            type=_json_str_list,
            default=["*"],
            help=f'CORS: the {name} browsers may use, as a JSON list (default ["*"])',
        )
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    server.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=_UVICORN_LOG_LEVELS,
        help="uvicorn's own log level (debug also logs each request)",
    )
    server.add_argument(
        "--root-path", default="", help="the path prefix of a proxy in front of the server"
    )
    server.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="serve no API docs (/docs, /redoc, /openapi.json)",
    )
    tls.add_cli_args(server)


def _json_str_list(text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form: --allowed-origins '["https://a.example"]')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings like ["*"], got {text}')
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `--config FILE`'s flags before it (so the command line wins) and
    a first positional MODEL as `--model`."""
    parser = make_arg_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.config is not None:
        args = parser.parse_args(_config_file_args(parser, args.config) + argv)
    if args.model_tag is not None:
        given = any(arg == "--model" or arg.startswith("--model=") for arg in argv)
        if given and args.model != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    return args


def _config_file_args(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """`path`'s YAML mapping as command-line flags: a key is a flag's long name (dashes or
    underscores), a value its argument (true/false for switches, a list for a flag that takes
    several, a mapping for a JSON flag). Unknown keys are an error, not ignored."""
    import yaml

    try:
        with open(path) as f:
            mapping = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"--config {path}: cannot read it as YAML: {e}")
    if mapping is None:
        return []
    if not isinstance(mapping, dict):
        parser.error(
            f"--config {path}: expected a mapping of flags (`port: 8000`), got YAML "
            f"{type(mapping).__name__}"
        )
    actions = {opt: action for action in parser._actions for opt in action.option_strings}
    argv: list[str] = []
    for key, value in mapping.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag in ("--config", "--help"):
            parser.error(
                f"--config {path}: {key!r} is not a flag of python -m v1engine.serve (see --help)"
            )
        argv += _flag_args(parser, path, flag, action, value)
    return argv


def _flag_args(parser, path: str, flag: str, action: argparse.Action, value: Any) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
        if not isinstance(value, bool):
            parser.error(f"--config {path}: {flag[2:]} takes true or false, got {value!r}")
        if isinstance(action, argparse._StoreTrueAction):
            return [flag] if value else []
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [flag, *(_flag_value(item) for item in value)]
    return [flag, _flag_value(value)]


def _flag_value(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from v1engine.entrypoints.openai.startup import run_server

    try:
        return run_server(args)
    except (ValueError, RuntimeError) as e:
        logger.error("cannot start the server: %s", e)
        return 2
    except KeyboardInterrupt:
        logger.info("interrupted during start-up")
        return 0


if __name__ == "__main__":
    sys.exit(main())
