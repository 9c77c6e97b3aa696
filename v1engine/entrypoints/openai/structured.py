"""A request's output constraint: OpenAI's `response_format`, vLLM's `structured_outputs` and
`guided_*` fields, or the tools' schema (tool_calls.py) -> one `StructuredOutputsParams`.

A request sets at most one constraint; each error names the request's own field (its `param`),
not the engine's name for it.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from typing import Any

from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.protocol_structured import StructuredFields
from v1engine.entrypoints.openai.serving_options import ServingOptions
from v1engine.structured_outputs.params import KINDS, StructuredOutputsParams

# A constraint as the request gave it: (the request's field, StructuredOutputsParams fields).
Constraint = tuple[str, dict[str, Any]]
_GUIDED_KINDS = ("json", "regex", "choice", "grammar")
_BACKENDS = ("xgrammar", "auto")
_FIELDS = {f.name for f in fields(StructuredOutputsParams)}
# The request fields this module reads: a request that sets none of them has no constraint.
CONSTRAINT_FIELDS = tuple(StructuredFields.model_fields)
_KIND_NAME = re.compile(rf"StructuredOutputsParams\.(?:{'|'.join(KINDS)})\b")


def request_constraint(
    request: StructuredFields, options: ServingOptions, tools: Constraint | None = None
) -> tuple[str, StructuredOutputsParams] | None:
    """The request's one constraint as (its field, params), or None.

    Raises:
        APIError: 400 for more than one constraint, or one that is malformed, naming its field.
    """
    constraints = _given_constraints(request, options)
    if tools is not None:
        constraints.append(tools)
    if not constraints:
        return None
    if len(constraints) > 1:
        names = [name for name, _ in constraints]
        raise APIError(
            f"a request takes one output constraint, got {len(names)}: {', '.join(names)}; "
            "keep one of them",
            param=names[0],
        )
    param, fields = constraints[0]
    unknown = sorted(fields.keys() - _FIELDS)
    if unknown:
        raise APIError(
            f"{param} has no field {', '.join(map(repr, unknown))}; its fields are "
            f"{', '.join(sorted(_FIELDS))}",
            param=param,
        )
    try:
        return param, StructuredOutputsParams(**fields)
    except ValueError as e:
        raise APIError(in_request_terms(e, param), param=param) from e


def in_request_terms(error: ValueError, param: str) -> str:
    """The engine's message about a constraint, naming the request's field instead of
    StructuredOutputsParams' (`StructuredOutputsParams.regex` is `guided_regex` of a
    guided_regex, `structured_outputs.regex` of a structured_outputs)."""
    message = str(error)
    if "StructuredOutputsParams" not in message:
        return f"invalid {param}: {message}"
    if param != "structured_outputs":
        message = _KIND_NAME.sub(param, message)
    return message.replace("StructuredOutputsParams", param)


def _given_constraints(request: StructuredFields, options: ServingOptions) -> list[Constraint]:
    backend = request.guided_decoding_backend
    if backend is not None and backend not in _BACKENDS:
        raise APIError(
            f"guided_decoding_backend {backend!r} is not supported; use one of {_BACKENDS}",
            param="guided_decoding_backend",
        )
    if request.guided_whitespace_pattern is not None:
        # The outlines backend's option; xgrammar's whitespace is on or off.
        raise APIError(
            "guided_whitespace_pattern is not supported by the xgrammar backend; use "
            'structured_outputs {"json": ..., "disable_any_whitespace": true} for compact JSON',
            param="guided_whitespace_pattern",
        )
    compact = {"disable_any_whitespace": options.disable_any_whitespace}
    constraints = []
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        constraints.append(("response_format", {"json_object": True, **compact}))
    elif response_format is not None and response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise APIError(
                'response_format {"type": "json_schema"} needs json_schema.schema',
                param="response_format",
            )
        constraints.append(("response_format", {"json": spec.json_schema, **compact}))
    elif response_format is not None and response_format.type == "structural_tag":
        tag = json.dumps(response_format.model_dump(exclude_none=True))
        constraints.append(("response_format", {"structural_tag": tag}))
    if request.structured_outputs is not None:
        constraints.append(("structured_outputs", {**compact, **request.structured_outputs}))
    for kind in _GUIDED_KINDS:
        value = getattr(request, f"guided_{kind}")
        if value is not None:
            constraints.append((f"guided_{kind}", {kind: value, **compact}))
    return constraints
