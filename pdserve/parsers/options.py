"""Per-request parser policy (spec §2.2, "Request policy")."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class ToolsMode(Enum):
    EMIT = "emit"          # tools were sent and tool_choice != "none"
    SUPPRESS = "suppress"  # calls are still parsed, then swallowed: markup never becomes content


class Emission(Enum):
    INCREMENTAL = "incremental"  # name at the invoke header, arguments as they arrive
    ATOMIC = "atomic"            # a call's events are released only once it is complete


@dataclass(frozen=True)
class ParamSchema:
    """What a tool's JSON schema says about one parameter, as far as the parsers use it."""

    kind: str | None = None  # the JSON schema type (the first non-null one of a union)
    nullable: bool = False   # `null` is allowed (`"type": [..., "null"]` or `"nullable": true`)


# tool name -> parameter name -> schema. A tool listed here has exactly these properties.
ToolSchemas = Mapping[str, Mapping[str, ParamSchema]]


@dataclass(frozen=True)
class ParserOptions:
    tools_mode: ToolsMode = ToolsMode.EMIT
    parallel_tool_calls: bool = True
    strict: bool = False
    emission: Emission | None = None           # None: ATOMIC when strict (sent deltas can't be recalled)
    separate_reasoning: bool = True            # False: reasoning text is reported as content
    start_in_reasoning: bool = False           # see profiles.prompt_opens_reasoning
    call_id_prefix: str = "call"               # ids are f"{call_id_prefix}_{index}"
    stop_ids: frozenset[int] = frozenset()     # extra end-of-output ids (generation_config)
    known_tools: frozenset[str] | None = None  # names from the request; used by drop_unknown_tools
    drop_unknown_tools: bool = False
    # tool name -> parameter name -> JSON schema type. GLM writes string values raw, so only the
    # schema tells "3" the string from 3 the number; DSML carries string="true|false" itself.
    # Superseded by `schemas` (which also knows nullability and untyped properties); still read
    # when `schemas` is empty so existing callers keep working.
    param_types: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # tool_schemas(request.tools): values are typed by the schema (docs/tool-calls.md §4).
    schemas: ToolSchemas = field(default_factory=dict)

    def tool_schema(self, tool: str) -> Mapping[str, ParamSchema] | None:
        """The parameters of `tool` from the request, or None when the request did not describe it."""
        if self.schemas:
            return self.schemas.get(tool)
        types = self.param_types.get(tool)
        return None if types is None else {k: ParamSchema(v) for k, v in types.items()}

    def param_schema(self, tool: str, param: str) -> ParamSchema | None:
        props = self.tool_schema(tool)
        return None if props is None else props.get(param)

    @property
    def emission_mode(self) -> Emission:
        if self.emission is not None:
            return self.emission
        return Emission.ATOMIC if self.strict else Emission.INCREMENTAL

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel_tool_calls else 1


def param_types_from_tools(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, str]]:
    """OpenAI `tools` -> {name: {param: type}} (first listed type when a union is given)."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool)
        props = (fn.get("parameters") or {}).get("properties") or {}
        types: dict[str, str] = {}
        for key, schema in props.items():
            kind = schema.get("type") if isinstance(schema, Mapping) else None
            if isinstance(kind, list):
                kind = next((k for k in kind if k != "null"), None)
            if isinstance(kind, str):
                types[key] = kind
        out[str(fn.get("name", ""))] = types
    return out


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, ParamSchema]]:
    """OpenAI `tools` -> {name: {param: ParamSchema}}; every listed property is kept, typed or not."""
    out: dict[str, dict[str, ParamSchema]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool)
        props = (fn.get("parameters") or {}).get("properties") or {}
        params: dict[str, ParamSchema] = {}
        for key, schema in props.items():
            params[str(key)] = _param_schema(schema) if isinstance(schema, Mapping) else ParamSchema()
        out[str(fn.get("name", ""))] = params
    return out


def _param_schema(schema: Mapping[str, Any]) -> ParamSchema:
    kind = schema.get("type")
    nullable = bool(schema.get("nullable"))
    if isinstance(kind, list):
        nullable = nullable or "null" in kind
        kind = next((k for k in kind if k != "null"), None)
    elif kind is None:  # anyOf/oneOf: [{"type": "string"}, {"type": "null"}]
        kinds = [s.get("type") for s in (schema.get("anyOf") or schema.get("oneOf") or ())
                 if isinstance(s, Mapping)]
        nullable = nullable or "null" in kinds
        kind = next((k for k in kinds if isinstance(k, str) and k != "null"), None)
    return ParamSchema(kind if isinstance(kind, str) else None, nullable)
