"""Logging for v1engine: `logger = init_logger(__name__)`.

This is the only module that reads the environment: `V1ENGINE_LOG_LEVEL` (default INFO).
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(name)s%(rank)s] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"
_rank: int | None = None
_configured = False


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = "" if _rank is None else f" rank={_rank}"
        return True


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger("v1engine")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
    handler.addFilter(_RankFilter())
    root.addHandler(handler)
    root.setLevel(os.environ.get("V1ENGINE_LOG_LEVEL", "INFO").upper())
    root.propagate = False


def init_logger(name: str) -> logging.Logger:
    _configure_root()
    return logging.getLogger(name)


def set_process_rank(rank: int | None) -> None:
    """Tags every later log line of this process with its worker rank."""
    global _rank
    _rank = rank


def is_rank0() -> bool:
    return _rank in (None, 0)


def info_once(logger: logging.Logger, msg: str, *args: object) -> None:
    """INFO from rank 0 (or the engine process) only, so N workers do not print N copies."""
    if is_rank0():
        logger.info(msg, *args)
