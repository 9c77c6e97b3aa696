"""v1engine: a readable multi-process LLM inference engine following vLLM's V1 architecture."""

from __future__ import annotations

from v1engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from v1engine.engine_args import EngineArgs

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "DeviceConfig",
    "EngineArgs",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "__version__",
]
