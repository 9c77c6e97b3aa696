"""The models a server serves: its base model under each served name, and the LoRA adapters that
`--lora-modules` names (vLLM's OpenAIServingModels). A request's `model` picks one: a base name
runs the base model, an adapter's name runs that adapter, anything else is a 404.

With V1ENGINE_ALLOW_RUNTIME_LORA_UPDATING=1 (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), adapters
are added and removed while the server runs (`POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`). An added adapter is read and checked first (a bad one is a 400), and
gets an id never used before, since the workers keep an id's weights; a removed one finishes
the requests it runs.
"""

from __future__ import annotations

import json
import os
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.protocol import ModelCard
from v1engine.lora.adapter import CheckedAdapters, load_adapter
from v1engine.lora.request import LoRARequest

RUNTIME_UPDATES_ENV = "V1ENGINE_ALLOW_RUNTIME_LORA_UPDATING"


# Unknown fields (vLLM's `load_inplace`, say) are a 400 naming them, not silently dropped.
class LoadLoRAAdapterRequest(BaseModel, extra="forbid"):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel, extra="forbid"):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's: when given, the named adapter's id


class ServedModels:
    def __init__(self, names: list[str], loras: dict[str, LoRARequest]) -> None:
        self.names = names  # the base model's; the first is the one reported back
        self.loras = loras  # adapter name -> its LoRARequest

    def check(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: a base name, or no name: the default).

        Raises:
            APIError: 404 naming what this server serves.
        """
        if model is None or model in self.names:
            return None
        lora = self.loras.get(model)
        if lora is None:
            served = ", ".join(repr(n) for n in [*self.names, *self.loras])
            raise APIError(
                f"the model `{model}` does not exist; this server serves {served}",
                HTTPStatus.NOT_FOUND,
                param="model",
            )
        return lora

    def response_model(self, request: Any) -> str:
        """The `model` a reply names: an adapter's name for its requests (as vLLM), else the
        base model's first served name."""
        return request.model if request.model in self.loras else self.names[0]

    def cards(self, model_path: str, max_model_len: int) -> list[ModelCard]:
        """/v1/models: each base name, then each adapter (`parent`: the model it adapts)."""
        cards = [ModelCard(id=n, root=model_path, max_model_len=max_model_len) for n in self.names]
        for name, lora in self.loras.items():
            parent = lora.base_model_name or self.names[0]
            cards.append(ModelCard(id=name, root=lora.lora_path, parent=parent))
        return cards

    def load(self, request: LoadLoRAAdapterRequest, adapters: CheckedAdapters | None) -> str:
        """Adds an adapter, read and checked by the engine's `adapters` (None: the engine
        serves none); returns the success message. Raises APIError: 404 when runtime updates
        are off, 400 for a taken name or an adapter the engine cannot serve."""
        _require_runtime_updates()
        name = request.lora_name
        if adapters is None:
            raise APIError("this engine serves no LoRA adapters; start it with --enable-lora")
        if name in self.loras or name in self.names:
            raise APIError(f"the model name {name!r} is already served", param="lora_name")
        used = [lora.lora_int_id for lora in self.loras.values()] + list(adapters.paths)
        try:
            lora = LoRARequest(name, max(used, default=0) + 1, request.lora_path)
            adapters.check(lora)
        except ValueError as e:
            raise APIError(str(e), param="lora_path") from e
        self.loras[name] = lora
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, request: UnloadLoRAAdapterRequest) -> str:
        """Removes an adapter by name; returns the success message. Raises APIError 404 when
        runtime updates are off or no adapter has that name."""
        _require_runtime_updates()
        lora = self.loras.get(request.lora_name)
        if lora is None:
            raise APIError(
                f"no LoRA adapter is named {request.lora_name!r}",
                HTTPStatus.NOT_FOUND,
                param="lora_name",
            )
        if request.lora_int_id not in (None, lora.lora_int_id):
            raise APIError(
                f"LoRA adapter {request.lora_name!r} has lora_int_id {lora.lora_int_id}, not "
                f"{request.lora_int_id}; send its id or none",
                param="lora_int_id",
            )
        del self.loras[request.lora_name]
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."


def _require_runtime_updates() -> None:
    if os.environ.get(RUNTIME_UPDATES_ENV, "").lower() not in ("1", "true"):
        raise APIError(
            f"adding and removing LoRA adapters at runtime is off; start the server with "
            f"{RUNTIME_UPDATES_ENV}=1",
            HTTPStatus.NOT_FOUND,
        )


def parse_lora_modules(specs: list[str]) -> dict[str, LoRARequest]:
    """`--lora-modules` values, vLLM's two forms: `name=path`, or a JSON object with `name`,
    `path` and optionally `base_model_name`. Adapters get ids 1, 2, ... in order.

    Raises:
        ValueError: a malformed spec, or a name given twice.
    """
    loras: dict[str, LoRARequest] = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                fields = json.loads(spec)
                name, path = fields["name"], fields["path"]
                base = fields.get("base_model_name")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"--lora-modules {spec!r}: a JSON spec needs 'name' and 'path' ({e})"
                ) from e
        else:
            name, sep, path = spec.partition("=")
            base = None
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {spec!r}: expected name=path")
        if name in loras:
            raise ValueError(f"--lora-modules names adapter {name!r} twice")
        loras[name] = LoRARequest(name, len(loras) + 1, path, base)
    return loras


def check_lora_modules(loras: dict[str, LoRARequest], config: Any) -> None:
    """At start-up, before the engine: every `--lora-modules` adapter must load on this model.

    Raises:
        ValueError: --lora-modules without --enable-lora, or an adapter it cannot serve.
    """
    lora_config = config.lora_config
    if loras and lora_config is None:
        raise ValueError("--lora-modules needs --enable-lora (the engine serves no adapters)")
    for lora in loras.values():
        load_adapter(lora.lora_path, config.model_config.hf_config, lora_config.max_lora_rank)
