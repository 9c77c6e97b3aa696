"""Start-up pieces of the API server: the listening socket, the served model names and the one
start-up line (which reports the KV cache the engine's READY message described).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from v1engine.core_protocol import EngineCoreInfo
from v1engine.logger import init_logger

logger = init_logger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket, bound before the engine starts so a busy port fails at once
    (port 0 picks a free one; the start-up line shows which).

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


def log_startup_line(address: tuple, model: str, names: list[str], config: Any, kv: str) -> None:
    """The one line that says where the server listens and what it serves."""
    from v1engine.model.hf_config import resolve_dtype

    device_type = config.device_config.device_type
    dtype = resolve_dtype(config.model_config.hf_config, config.model_config.dtype, device_type)
    host, port = address[0], address[1]
    host = f"[{host}]" if ":" in host else host
    logger.info(
        "v1engine API server listening on http://%s:%d | model %s served as %s | "
        "tensor_parallel_size=%d device=%s dtype=%s | %s",
        host,
        port,
        model,
        ", ".join(names),
        config.parallel_config.tensor_parallel_size,
        device_type,
        str(dtype).removeprefix("torch."),
        kv,
    )
