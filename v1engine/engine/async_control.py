"""AsyncLLM's engine-wide calls, by vLLM's names: the prefix cache, the workers' profiler, sleep
mode (core/engine_core.py says what each does) and `collective_rpc`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from v1engine.engine.core_client import AsyncMPClient


class AsyncEngineControl:
    client: AsyncMPClient
    # Set from `sleep` until `wake_up` woke everything: AsyncLLM refuses new requests meanwhile.
    sleeping: bool = False

    async def reset_prefix_cache(self) -> bool:
        return await self.client.reset_prefix_cache()

    async def start_profile(self) -> None:
        # Needs profiler_config (config.ProfilerConfig).
        await self.client.call_utility("profile", is_start=True)

    async def stop_profile(self) -> None:
        await self.client.call_utility("profile", is_start=False)

    async def sleep(self, level: int = 1) -> None:
        """Needs enable_sleep_mode; refused while requests run."""
        self.sleeping = True  # no request may slip in while the workers go to sleep
        try:
            await self.client.call_utility("sleep", level=level)
        except Exception:
            self.sleeping = await self.is_sleeping()  # e.g. it slept already
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.client.call_utility("wake_up", tags=tags)
        self.sleeping = await self.is_sleeping()

    async def is_sleeping(self) -> bool:
        return await self.client.call_utility("is_sleeping")

    async def collective_rpc(
        self,
        method: str | Callable,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Runs `method` on every worker (see `EngineCore.collective_rpc`)."""
        return await self.client.collective_rpc(method, args, kwargs, timeout, unique_reply_rank)
