"""Values typed by the request's tool schema (docs/tool-calls.md §4).

A value the model wrote as a string (DSML `string="true"`, any GLM value) takes the schema's
type when the conversion loses nothing: the string is exactly the JSON text of a value of that
type. `"42"` becomes 42 for an integer; `"042"`, `"4.0"` and `"forty"` stay strings.
"""
from __future__ import annotations

import json
from typing import NamedTuple

from pdserve.parsers.calls import valid_json
from pdserve.parsers.options import ParamSchema

CONVERTIBLE = frozenset({"integer", "number", "boolean", "object", "array"})


class Conversion(NamedTuple):
    literal: str  # the JSON text to splice into the arguments
    converted: bool  # the value took a type other than string
    failed: bool     # the schema asked for a type this value cannot take without loss


def wants_conversion(schema: ParamSchema | None) -> bool:
    """Whether a string value of this parameter must be buffered until it is complete."""
    return schema is not None and (schema.kind in CONVERTIBLE or (schema.kind == "string" and schema.nullable))


def convert(text: str, schema: ParamSchema) -> Conversion:
    """`text` (a string value, unquoted) as the schema's type, or as a JSON string when it can't be."""
    as_string = json.dumps(text, ensure_ascii=False)
    if schema.nullable and text == "null":
        return Conversion("null", True, False)
    if schema.kind not in CONVERTIBLE:
        return Conversion(as_string, False, False)
    if valid_json(text) and text == text.strip() and _is_kind(json.loads(text), schema.kind):
        return Conversion(text, True, False)
    return Conversion(as_string, False, True)


def matches(literal: str, schema: ParamSchema | None) -> bool:
    """Whether a JSON literal the model wrote already has the schema's type (or no type is asked)."""
    if schema is None or schema.kind is None:
        return True
    value = json.loads(literal)
    return (value is None and schema.nullable) or _is_kind(value, schema.kind)


def _is_kind(value: object, kind: str | None) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "null":
        return value is None
    return True
