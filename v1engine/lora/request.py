"""LoRARequest: the adapter one request runs with (vLLM's name and fields)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """A PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`) under a
    name. `lora_int_id` (>= 1) identifies the adapter to the workers, which load it once and
    keep it: give each distinct adapter its own id."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    # The model the adapter was trained on, as the server lists it (vLLM's).
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}"
            )
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"LoRARequest.lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be >= 1, got {self.lora_int_id}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"LoRARequest {self.lora_name!r}: lora_path must name the adapter's folder"
            )


def adapter_counts(running: Iterable[Any], waiting: Iterable[Any]) -> dict[str, dict[str, int]]:
    """vLLM's adapter name -> request counts, of the running and of the waiting requests (each
    with a `lora_request`), as the scheduler's stats carry them."""
    running_counts, waiting_counts = (
        Counter(r.lora_request.lora_name for r in queue if r.lora_request)
        for queue in (running, waiting)
    )
    return {
        "running_lora_adapters": dict(running_counts),
        "waiting_lora_adapters": dict(waiting_counts),
    }
