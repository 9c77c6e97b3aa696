"""The models a server serves: its base model under each served name, and the LoRA adapters that
`--lora-modules` names (vLLM's OpenAIServingModels). A request's `model` picks one: a base name
runs the base model, an adapter's name runs that adapter, anything else is a 404.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from v1engine.entrypoints.openai.errors import APIError
from v1engine.lora.request import LoRARequest


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
