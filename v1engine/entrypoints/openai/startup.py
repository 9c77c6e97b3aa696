"""The API server's start-up, from parsed flags to a serving app: `run_server` checks the flags,
binds the socket, starts the engine core and, while the core starts, imports the HTTP app and
loads the tokenizer on a helper thread; then api_server.py serves. Also the served model names
and the one start-up line (which reports the KV cache the engine's READY message described).

This module and `v1engine.serve` keep heavy imports out of their tops: every process that
multiprocessing spawns (the engine core, then each worker) re-imports the launching module
`v1engine.serve` first. In this process the flag parser's modules (limits, structured outputs)
load fastapi before the core starts (~0.3 s); the rest of the app (routes, protocol models,
uvicorn) loads on the helper thread.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from typing import Any

from v1engine.core_protocol import EngineCoreInfo
from v1engine.engine.core_client import EngineCoreClient
from v1engine.engine.generation_defaults import describe
from v1engine.engine.stat_logger import log_stats_interval_s
from v1engine.engine_args import EngineArgs
from v1engine.logger import init_logger
from v1engine.process import install_sigterm_handler

logger = init_logger(__name__)

_APP_MODULE = "v1engine.entrypoints.openai.api_server"


def run_server(args: argparse.Namespace) -> int:
    """Runs the server until a signal (returns 0) or the engine's death (returns 1).

    Raises:
        ValueError / RuntimeError: bad arguments, a busy port, or an engine that cannot start.
    """
    from v1engine.entrypoints.openai.limits import RequestLimits  # loaded by the flag parser
    from v1engine.entrypoints.openai.serving_models import check_lora_modules
    from v1engine.entrypoints.openai.serving_options import ServingOptions
    from v1engine.entrypoints.openai.tls import check_tls_args

    # Until uvicorn takes over the signals, SIGTERM unwinds like Ctrl-C, stopping the engine.
    install_sigterm_handler()
    engine_args = EngineArgs.from_cli_args(args)
    limits = RequestLimits.from_cli_args(args)
    options = ServingOptions.from_cli_args(args)
    check_tls_args(args)
    # A bad V1ENGINE_LOG_STATS_INTERVAL fails here, before the engine starts.
    stats_interval_s = None if args.disable_log_stats else log_stats_interval_s()
    if engine_args.model is None:
        from v1engine.model.hf_config import default_model_path

        engine_args.model = default_model_path()
    config = engine_args.create_engine_config()
    check_lora_modules(options.lora_modules, config)
    if config.model_config.sampling_defaults:
        logger.info(describe(config.model_config))
    names = served_model_names(args.served_model_name, args.model, engine_args.model)
    sock = bind_socket(args.host, args.port)
    try:
        # Outside any event loop, so Ctrl-C interrupts a slow start-up at once; the app's
        # imports run on the tokenizer's thread meanwhile.
        client, tokenizer = EngineCoreClient.start_with_tokenizer(
            config, multiprocess=True, preload=_APP_MODULE
        )
        try:
            # All loaded on the helper thread by now.
            from v1engine.engine.async_llm import AsyncLLM
            from v1engine.engine.metrics import ServerMetrics
            from v1engine.entrypoints.openai.api_server import build_state, serve

            metrics = ServerMetrics(names[0], config.scheduler_config.max_model_len)
            engine = AsyncLLM(client, tokenizer, config, metrics)
            state = build_state(engine, tokenizer, names, engine_args.model, limits, options)
            return asyncio.run(serve(args, state, sock, stats_interval_s))
        finally:
            client.shutdown()
    finally:
        sock.close()


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket, bound before the engine starts so a busy port fails at once (port 0 picks
    a free one; the start-up line shows which); `serve` listens on it once the engine is ready,
    so that until then a client is refused at once rather than left waiting.

    Raises:
        RuntimeError: the address cannot be bound, naming it and the fix.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise RuntimeError(
            f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or stop the "
            "process using it"
        ) from e
    sock.set_inheritable(False)  # the engine and worker processes must not hold it open
    return sock


def served_model_names(
    names: list[str] | None, model_arg: str | None, model_path: str
) -> list[str]:
    """`--served-model-name` if given, else `--model` as typed (as vLLM), else the default
    model's file name without its extension.
    """
    if names:
        return list(names)
    if model_arg is not None:
        return [model_arg]
    return [os.path.splitext(os.path.basename(model_path))[0]]


def describe_kv_capacity(info: EngineCoreInfo) -> str:
    num_tokens = info.num_blocks * info.block_size
    return (
        f"KV cache {info.num_blocks} blocks x {info.block_size} tokens = {num_tokens} tokens "
        f"({num_tokens / info.max_model_len:.1f}x max_model_len {info.max_model_len})"
    )


def log_startup_line(
    url_scheme: str, address: tuple, model: str, names: list[str], config: Any, kv: str
) -> None:
    """The one line that says where the server listens and what it serves."""
    from v1engine.model.hf_config import pooling_task, resolve_dtype

    device_type = config.device_config.device_type
    hf_config = config.model_config.hf_config
    dtype = resolve_dtype(hf_config, config.model_config.dtype, device_type)
    runner = config.model_config.runner_type
    if runner == "pooling":
        runner += f" ({pooling_task(hf_config)})"  # what the pooling endpoints get
    host, port = address[0], address[1]
    host = f"[{host}]" if ":" in host else host
    logger.info(
        "v1engine API server listening on %s://%s:%d | model %s served as %s | "
        "tensor_parallel_size=%d device=%s dtype=%s runner=%s | %s",
        url_scheme,
        host,
        port,
        model,
        ", ".join(names),
        config.parallel_config.tensor_parallel_size,
        device_type,
        str(dtype).removeprefix("torch."),
        runner,
        kv,
    )
