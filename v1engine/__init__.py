"""v1engine: a readable multi-process LLM inference engine following vLLM's V1 architecture.

    from v1engine import LLM, SamplingParams, EngineArgs   # and AsyncLLM, for asyncio code

`LLMEngine` is vLLM's step-by-step offline engine under `LLM`. `LLM`, `LLMEngine`, `AsyncLLM` and
`EngineCore` are imported on first use: worker processes import this
package too, and must not pay for the front end's imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from v1engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from v1engine.engine_args import EngineArgs
from v1engine.lora.request import LoRARequest
from v1engine.pooling_params import PoolingParams
from v1engine.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from v1engine.core.engine_core import EngineCore
    from v1engine.engine.async_llm import AsyncLLM
    from v1engine.engine.llm_engine import LLMEngine
    from v1engine.entrypoints.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLM",
    "BeamSearchParams",
    "CacheConfig",
    "DeviceConfig",
    "EngineArgs",
    "EngineConfig",
    "EngineCore",
    "LoRARequest",
    "ModelConfig",
    "ParallelConfig",
    "PoolingParams",
    "SamplingParams",
    "SchedulerConfig",
    "__version__",
]

_LAZY = {
    "LLM": "v1engine.entrypoints.llm",
    "LLMEngine": "v1engine.engine.llm_engine",
    "AsyncLLM": "v1engine.engine.async_llm",
    "EngineCore": "v1engine.core.engine_core",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'v1engine' has no attribute {name!r}")
