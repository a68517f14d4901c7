"""OpenAI (and vLLM) request fields → one ``GrammarSpec``: what the output must match.

Pure functions on the request's plain values, used by the router; compiling is ``Grammars``'.
A malformed field raises ``SpecError`` naming it.

* ``response_format``: ``{"type": "json_object"}`` (any JSON object) and ``{"type":
  "json_schema", "json_schema": {"name", "schema", "strict"}}``.
* vLLM's extras: ``structured_outputs: {"json" | "regex" | "choice" | "grammar" |
  "json_object": …}`` (exactly one), and the older ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar`` fields.
* Tool calls for models without a call syntax of their own: the output is a JSON call
  ``{"name": …, "arguments": {…}}`` (``tool_call_schema``), or a list of them.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.worker_api import GrammarKind, GrammarSpec

ANY_OBJECT = {"type": "object"}
VLLM_KEYS = {"json": GrammarKind.JSON_SCHEMA, "regex": GrammarKind.REGEX, "choice": GrammarKind.CHOICE,
             "grammar": GrammarKind.GRAMMAR}
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class SpecError(ValueError):
    """A constraint field is malformed; ``param`` names it (the 400's ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _json(value: Any) -> str:
    # Compact but in the client's key order: the grammar writes an object's properties in the
    # order its schema lists them (as OpenAI's strict mode does), so sorting would reorder them.
    return json.dumps(value, separators=(",", ":"))


def from_response_format(rf: Mapping[str, Any] | None) -> GrammarSpec | None:
    """``response_format``; None for ``text`` (or none)."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_SCHEMA, _json(ANY_OBJECT))
    if kind != "json_schema":
        raise SpecError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                        "response_format")
    body = rf.get("json_schema")
    if not isinstance(body, Mapping):
        raise SpecError("response_format of type 'json_schema' needs a 'json_schema' object "
                        "({\"name\": …, \"schema\": {…}, \"strict\": …})", "response_format")
    schema = body.get("schema", ANY_OBJECT)
    if not isinstance(schema, (Mapping, bool)):
        raise SpecError("response_format.json_schema.schema must be a JSON Schema object", "response_format")
    return GrammarSpec(GrammarKind.JSON_SCHEMA, _json(schema), strict=body.get("strict") is True)


def from_vllm(structured_outputs: Mapping[str, Any] | None, guided: Mapping[str, Any]) -> GrammarSpec | None:
    """vLLM's ``structured_outputs`` object, or its ``guided_*`` fields (`guided`: those set)."""
    if structured_outputs is not None and guided:
        raise SpecError("use either structured_outputs or the guided_* fields, not both", "structured_outputs")
    if structured_outputs is None:
        if len(guided) > 1:
            raise SpecError(f"only one of {', '.join(sorted(guided))} may be set", sorted(guided)[0])
        if not guided:
            return None
        name, value = next(iter(guided.items()))
        return _vllm_entry(GUIDED_FIELDS[name], value, name)
    chosen = {k: v for k, v in structured_outputs.items()
              if k in (*VLLM_KEYS, "json_object") and v is not None and v is not False}
    if len(chosen) != 1:
        raise SpecError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                        f"got {sorted(chosen) or 'none'}", "structured_outputs")
    key, value = next(iter(chosen.items()))
    return _vllm_entry(key, value, f"structured_outputs.{key}")


def _vllm_entry(key: str, value: Any, param: str) -> GrammarSpec:
    if key == "json_object":
        return GrammarSpec(GrammarKind.JSON_SCHEMA, _json(ANY_OBJECT))
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise SpecError(f"{param} is not valid JSON: {e}", param) from None
        if not isinstance(value, (Mapping, bool)):
            raise SpecError(f"{param} must be a JSON Schema object", param)
        return GrammarSpec(GrammarKind.JSON_SCHEMA, _json(value))
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise SpecError(f"{param} must be a non-empty list of strings", param)
        return GrammarSpec(GrammarKind.CHOICE, json.dumps(value))
    if not isinstance(value, str) or not value:
        raise SpecError(f"{param} must be a non-empty string", param)
    return GrammarSpec(VLLM_KEYS[key], value)


def tool_call_schema(tools: Sequence[Mapping[str, Any]], function: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON Schema of the calls a model without a call syntax must write: one call object
    ``{"name": <name>, "arguments": <its arguments_schema>}`` for a named function; for "required",
    one call of any tool, or with `parallel` a non-empty list of them."""
    used = [t["function"] for t in tools if function is None or t["function"]["name"] == function]
    calls = [call_schema(fn["name"], arguments_schema(fn.get("parameters"))) for fn in used]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if function is not None or not parallel:
        return one
    return {"type": "array", "items": one, "minItems": 1}


def arguments_schema(parameters: Any) -> dict[str, Any]:
    """The schema a call's arguments follow: the tool's `parameters` (left out or `{}`: no
    parameters, as OpenAI reads it), with only the listed properties when it lists some and says
    nothing of others (as OpenAI's strict mode has it): no extra keys for a model to wander into."""
    if not isinstance(parameters, Mapping) or not parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    schema = dict(parameters)
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def call_schema(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """One JSON call object, `{"name": <name>, "arguments": <arguments>}`, in that order."""
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def tools_strict(tools: Sequence[Mapping[str, Any]], function: str | None) -> bool:
    """Strict when every tool the calls may use says ``strict: true``."""
    used = [t["function"] for t in tools if function is None or t["function"]["name"] == function]
    return bool(used) and all(fn.get("strict") is True for fn in used)
