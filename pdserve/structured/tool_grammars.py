"""Grammars of the models' own tool-call syntax, so `tool_choice` "required" and named
functions are enforced by constrained decoding in the markup each model was trained on.

One Lark grammar (llguidance's dialect) per request: the calls in the model's syntax, with
each call's arguments following its tool's JSON schema. The parsers then read the constrained
output exactly as they read any output (docs/structured-outputs.md, "Tool choice on models
with a call syntax"):

* DSML (DeepSeek V3.2 / V4): `\\n\\n<｜DSML｜function_calls>` (`tool_calls` on V4), one `invoke`
  per call, one `parameter` per argument in the schema's order. A plain string is written as
  is with `string="true"` (no quotes, no escaping: the reference encoder's rule); every other
  value is JSON with `string="false"`, through the schema (`%json`).
* GLM: `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>…</tool_call>`; the
  newlines of GLM-4.5 are allowed, not required. String values are raw text, other types JSON
  (the parser types a raw value by the schema).
* Hermes (Qwen): `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`, one per call.
* DeepSeek V3 / R1 (fenced JSON) and V3.1 (bare JSON) between their call markers.

Markers are written as token ids (`<[id]>`), never as text: the parsers recognise them by id.
The llguidance backend treats every added token as special (llguidance_backend.py), so no
text lexeme — a free string value, a JSON string — can contain a marker id.

JSON inside calls is written with `", "` and `": "` and no other white space, as the models'
templates write it (`json.dumps`, `tojson`). A tool without `strict: true` gets llguidance's
lenient schema mode (unsupported keywords ignored), as JSON calls do.

`tool_choice: "auto"` with every tool strict gets the `optional` form: free text (reasoning
markers included) with calls anywhere in it, each held to its schema from its marker on.
"auto" with a JSON `response_format` gets the `answer` form: the calls, or instead of them the
answer in that format (compact JSON, as `response_format` alone writes it).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.parsers.profiles import Format, Profile
from pdserve.structured.spec import arguments_schema, call_schema
from pdserve.worker_api import GrammarKind, GrammarSpec

# Keywords a raw (unquoted) string value can honour: anything else on a string goes through
# the JSON schema (DSML) or is refused (GLM, which writes every string raw).
_RAW_STRING_KEYS = frozenset({"type", "description", "title", "default", "examples", "minLength", "maxLength",
                              "nullable", "$comment"})
_DOC_KEYS = frozenset({"description", "title", "default", "examples", "$comment"})


class ToolGrammarError(ValueError):
    """The tools cannot be written as a grammar of this model's call syntax (a 400 naming
    tool_choice)."""


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: Mapping[str, Any]  # its arguments' schema (`spec.arguments_schema`)
    strict: bool

    @classmethod
    def of(cls, tool: Mapping[str, Any]) -> Tool:
        fn = tool.get("function", tool)
        return cls(str(fn["name"]), arguments_schema(fn.get("parameters")), fn.get("strict") is True)


@dataclass(frozen=True)
class Param:
    name: str
    schema: Any  # the property's JSON schema, with the tool's $defs carried along
    required: bool


def call_syntax_grammar(profile: Profile, tools: Sequence[Mapping[str, Any]], function: str | None,
                        parallel: bool, model_opens_reasoning: bool = False, optional: bool = False,
                        answer: GrammarSpec | None = None) -> str:
    """The Lark grammar of the calls `tool_choice` asks for, in `profile`'s own syntax: a call to
    `function` (exactly one), or with `function` None one or more calls of any tool (one when
    `parallel` is false). `model_opens_reasoning`: the prompt leaves the reasoning section to
    the model, so one reasoning block (`<think>…</think>`) may come before the calls.
    `optional` ("auto" with strict tools): free text, with calls anywhere in it (at most one
    without `parallel`); only a call, once its marker is written, is constrained. `answer` (a
    JSON schema spec: "auto" with a response_format): the calls, or that answer instead."""
    chosen = [Tool.of(t) for t in tools]
    if function is not None:
        chosen = [t for t in chosen if t.name == function]
    if not chosen:
        raise ToolGrammarError(f"no tool named {function!r}" if function else "no tools to call")
    writer = _WRITERS.get(profile.format)
    if writer is None:
        raise ToolGrammarError(f"the {profile.name} output format has no tool-call syntax")
    g = _Lark()
    if optional:
        return g.text(_optional_calls(g, profile, chosen, parallel))
    calls = writer(g, profile, chosen, parallel and function is None)
    if answer is not None:
        assert answer.kind is GrammarKind.JSON_SCHEMA
        calls = f"({calls} | {g.json('answer', json.loads(answer.value), answer.strict, compact=True)})"
    if model_opens_reasoning and profile.think is not None:
        g.rule("reasoning", f"{tok(profile.think.start)} REASONING {tok(profile.think.end)} {NL}? {NL}?")
        g.terminal("REASONING", "/(?s:.*)/")
        calls = f"reasoning? {calls}"
    return g.text(calls)


def _optional_calls(g: _Lark, profile: Profile, tools: list[Tool], parallel: bool) -> str:
    """Text, then calls interleaved with text. Text is any text without marker ids (the
    backend's special tokens) except the think markers, so reasoning stays possible. A DSML
    call begins in the text's `<`: the text before a block is one lexeme ending in `<` (a
    greedy text lexeme would otherwise swallow a literal `<` and never reach the DSML id)."""
    think = profile.think
    marks = f" | {tok(think.start)} | {tok(think.end)}" if think is not None else ""
    g.terminal("TEXT", "/(?s:.+)/")
    g.rule("text", f"(TEXT{marks})+")
    if profile.format is Format.DSML:
        block = _dsml(g, profile, tools, parallel, opener=False)
        g.terminal("TEXT_LT", "/(?s:.*)</")
        g.rule("segment", f"text? TEXT_LT {block}")
    else:
        g.rule("segment", f"text? {_WRITERS[profile.format](g, profile, tools, parallel)}")
    return "segment* text?" if parallel else "segment? text?"


# ---- the Lark text --------------------------------------------------------------------------------

def tok(token_id: int) -> str:
    return f"<[{token_id}]>"


def lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


NL = lit("\n")
CLOSER = "<\\/"  # the `</` in front of a DSML closer, as a regex inside /…/
PARAM_NAME = lit('parameter name="')


class _Lark:
    """Rules and terminals collected while writing, emitted once (names are unique per call)."""

    def __init__(self) -> None:
        self._rules: dict[str, str] = {}
        self._terminals: dict[str, str] = {}

    def rule(self, name: str, body: str) -> str:
        self._rules[name] = body
        return name

    def terminal(self, name: str, body: str) -> str:
        self._terminals[name] = body
        return name

    def json(self, name: str, schema: Any, strict: bool, compact: bool = False) -> str:
        """A rule for one JSON value of `schema` with `", "` and `": "` (as the chat templates
        write calls), or with `compact`, `","` and `":"` (as a response_format is written)."""
        sep = (",", ":") if compact else (", ", ": ")
        options = {"whitespace_flexible": False, "item_separator": sep[0], "key_separator": sep[1],
                   "lenient": not strict}
        if schema is True:
            schema = {}
        if not isinstance(schema, Mapping):
            raise ToolGrammarError(f"the schema of {name} is not a JSON Schema object")
        return self.rule(name, "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False))

    def text(self, head: str) -> str:
        lines = [f"start: {head}"]
        lines += [f"{name}: {body}" for name, body in self._rules.items()]
        lines += [f"{name}: {body}" for name, body in self._terminals.items()]
        return "\n".join(lines) + "\n"


# ---- parameters -----------------------------------------------------------------------------------

def params_of(tool: Tool) -> list[Param] | None:
    """The tool's parameters in schema order, or None when its object takes any property (no
    `properties` listed and `additionalProperties` not false). Listed properties are the only
    ones written (as OpenAI's strict mode and the JSON calls have it): `"properties": {}` is a
    function without parameters."""
    schema = tool.parameters
    props = schema.get("properties")
    if props is None:
        return None if schema.get("additionalProperties", True) is not False else []
    if not isinstance(props, Mapping):
        raise ToolGrammarError(f"tool {tool.name!r}: parameters.properties must be an object")
    required = set(schema.get("required") or ())
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    out = []
    for key, sub in props.items():
        if isinstance(sub, Mapping) and defs:
            sub = {**defs, **sub}
        out.append(Param(str(key), sub, key in required))
    return out


def string_kind(schema: Any) -> str:
    """How a string value of `schema` is written raw: "plain" (any text, maybe length-bounded),
    "enum" (one of fixed strings), "any" (an untyped parameter), or "" (not raw)."""
    if schema is True or (isinstance(schema, Mapping) and not set(schema) - _DOC_KEYS - {"$defs", "definitions"}):
        return "any"
    if not isinstance(schema, Mapping):
        return ""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        rest = set(schema) - _DOC_KEYS - {"enum", "const", "type", "$defs", "definitions"}
        ok = schema.get("type", "string") == "string" and values and all(isinstance(v, str) for v in values)
        return "enum" if ok and not rest else ""
    if schema.get("type") == "string" and not set(schema) - _RAW_STRING_KEYS - {"$defs", "definitions"} \
            and not schema.get("nullable"):
        return "plain"
    return ""


def raw_text(g: _Lark, name: str, schema: Any, suffix: str = "") -> str:
    """A terminal of raw text for a string of `schema` (bounded by its min/maxLength), with
    `suffix` (a regex) inside the same lexeme: a greedy text lexeme only ends where the next
    byte cannot continue it, which the first byte of a special token is and a literal `</` is
    not."""
    lo = int(schema.get("minLength", 0)) if isinstance(schema, Mapping) else 0
    hi = schema.get("maxLength") if isinstance(schema, Mapping) else None
    count = f"{{{lo},{int(hi)}}}" if hi is not None else (f"{{{lo},}}" if lo else "*")
    return g.terminal(name.upper(), f"/(?s:.){count}{suffix}/")


def enum_text(schema: Mapping[str, Any]) -> str:
    values = schema.get("enum", [schema.get("const")])
    return "(" + " | ".join(lit(v) for v in values) + ")"


def _quoted(name: str, tool: Tool) -> str:
    if '"' in name or "\n" in name or ">" in name:
        raise ToolGrammarError(f"tool {tool.name!r}: the name {name!r} cannot be written in a DSML attribute")
    return f'"{name}"'


# ---- DSML -----------------------------------------------------------------------------------------

def _dsml(g: _Lark, profile: Profile, tools: list[Tool], many: bool, opener: bool = True) -> str:
    """The block; without `opener`, from the DSML id on (the text before wrote `\\n\\n<`)."""
    assert profile.dsml is not None
    d, block = tok(profile.dsml.dsml), profile.dsml.block_name
    invokes = []
    for i, tool in enumerate(tools):
        head = f'{lit("<")} {d} {lit("invoke name=" + _quoted(tool.name, tool) + ">" + chr(10))}'
        args = _dsml_args(g, d, tool, f"t{i}")
        invokes.append(g.rule(f"invoke{i}", f'{head} {args} {lit("</")} {d} {lit("invoke>")}'))
    g.rule("invoke", " | ".join(invokes))
    # The encoder joins invokes with one newline, inside one block that starts after "\n\n".
    invoke = f"(invoke {NL})+" if many else f"invoke {NL}"
    start = f'{lit(chr(10) * 2 + "<")} {d}' if opener else d
    return g.rule("block", f'{start} {lit(block + ">" + chr(10))} {invoke} {lit("</")} {d} {lit(block + ">")}')


def _dsml_args(g: _Lark, d: str, tool: Tool, prefix: str) -> str:
    """The parameters, each followed by a newline; no parameters is the encoder's blank line."""
    params = params_of(tool)
    if params is None:  # any properties: names are free, values raw or JSON
        value = _dsml_value(g, f"{prefix}_free", {}, tool.strict)
        name = g.terminal(f"{prefix.upper()}_NAME", '/[^"<>\\n]+/')
        param = g.rule(f"{prefix}_free", f'{lit("<")} {d} {PARAM_NAME} {name} '
                                         f'{lit(chr(34) + " string=" + chr(34))} {value} {d} '
                                         f'{lit("parameter>" + chr(10))}')
        return f"({NL} | {param}+)"
    seq = []
    for j, p in enumerate(params):
        head = f'{lit("<")} {d} {lit("parameter name=" + _quoted(p.name, tool) + " string=" + chr(34))}'
        value = _dsml_value(g, f"{prefix}_p{j}", p.schema, tool.strict)
        rule = g.rule(f"{prefix}_p{j}", f'{head} {value} {d} {lit("parameter>" + chr(10))}')
        seq.append(rule if p.required else f"{rule}?")
    if not seq:
        return NL
    if all(not p.required for p in params):
        return f'({NL} | {" ".join(seq)})'
    return " ".join(seq)


def _dsml_value(g: _Lark, name: str, schema: Any, strict: bool) -> str:
    """`true">TEXT</` or `false">JSON</` (the closer's `</` ends a raw value's own lexeme)."""
    string, json_ = lit('true">'), lit('false">')
    kind = string_kind(schema)
    if kind == "plain":
        return f"{string} {raw_text(g, name + '_raw', schema, CLOSER)}"
    if kind == "enum":
        return f'{string} {enum_text(schema)} {lit("</")}'
    as_json = f'{json_} {g.json(name + "_json", schema, strict)} {lit("</")}'
    if kind == "any":
        return f"({string} {raw_text(g, name + '_raw', {}, CLOSER)} | {as_json})"
    return as_json


# ---- GLM ------------------------------------------------------------------------------------------

def _glm(g: _Lark, profile: Profile, tools: list[Tool], many: bool) -> str:
    m = profile.glm
    assert m is not None
    nl = f"{NL}?"  # GLM-4.5 writes newlines between the tags, GLM-4.7 and GLM-5 do not
    calls = []
    for i, tool in enumerate(tools):
        params = params_of(tool)
        if params is None:
            key = g.terminal(f"T{i}_KEY", "/[^\\n]+/")
            value = raw_text(g, f"t{i}_free_raw", {})
            arg = g.rule(f"t{i}_free", f"{tok(m.key_open)} {key} {tok(m.key_close)} {nl} "
                                       f"{tok(m.value_open)} {value} {tok(m.value_close)} {nl}")
            args = f"{arg}*"
        else:
            seq = []
            for j, p in enumerate(params):
                value = _glm_value(g, f"t{i}_p{j}", p, tool)
                rule = g.rule(f"t{i}_p{j}", f"{tok(m.key_open)} {lit(p.name)} {tok(m.key_close)} {nl} "
                                            f"{tok(m.value_open)} {value} {tok(m.value_close)} {nl}")
                seq.append(rule if p.required else f"{rule}?")
            args = " ".join(seq)
        calls.append(g.rule(f"call{i}", f"{tok(m.call_open)} {lit(tool.name)} {nl} {args} {tok(m.call_close)}"))
    g.rule("call", " | ".join(calls))
    return f"call ({nl} call)*" if many else "call"


def _glm_value(g: _Lark, name: str, p: Param, tool: Tool) -> str:
    kind = string_kind(p.schema)
    if kind in ("plain", "any"):
        return raw_text(g, name + "_raw", p.schema if kind == "plain" else {})
    if kind == "enum":
        return enum_text(p.schema)
    if _allows_string(p.schema):
        raise ToolGrammarError(f"tool {tool.name!r}, parameter {p.name!r}: GLM writes string values raw, so only "
                               "a plain string, a string enum or a length bound can be enforced in its syntax "
                               "(not a pattern, a format, or a union with strings)")
    return g.json(name + "_json", p.schema, tool.strict)


def _allows_string(schema: Any) -> bool:
    if not isinstance(schema, Mapping):
        return True
    kind = schema.get("type")
    if kind is None:
        subs = schema.get("anyOf") or schema.get("oneOf")
        if subs:
            return any(_allows_string(s) for s in subs)
        values = schema.get("enum", [schema["const"]] if "const" in schema else None)
        return values is None or any(isinstance(v, str) for v in values)
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


# ---- Hermes and DeepSeek V3 / V3.1: a JSON body between markers -----------------------------------

def _hermes(g: _Lark, profile: Profile, tools: list[Tool], many: bool) -> str:
    m = profile.hermes
    assert m is not None
    bodies = [g.json(f"body{i}", call_schema(t.name, t.parameters), t.strict) for i, t in enumerate(tools)]
    g.rule("call", f'{tok(m.call_open)} {NL} ({" | ".join(bodies)}) {NL} {tok(m.call_close)}')
    return f"call ({NL} call)*" if many else "call"


def _dsv3(g: _Lark, profile: Profile, tools: list[Tool], many: bool) -> str:
    m = profile.dsv3
    assert m is not None
    calls = []
    for i, t in enumerate(tools):
        args = g.json(f"args{i}", t.parameters, t.strict)
        if m.fenced:  # V3 / R1: function<sep>NAME, then the arguments in a json fence
            body = f'{lit("function")} {tok(m.sep)} {lit(t.name + chr(10) + "```json" + chr(10))} {args} ' \
                   f'{lit(chr(10) + "```")}'
        else:  # V3.1: NAME<sep>ARGS
            body = f"{lit(t.name)} {tok(m.sep)} {args}"
        calls.append(g.rule(f"call{i}", f"{tok(m.call_begin)} {body} {tok(m.call_end)}"))
    g.rule("call", " | ".join(calls))
    inner = f"call ({NL}? call)*" if many else "call"
    return g.rule("block", f"{tok(m.calls_begin)} {inner} {tok(m.calls_end)}")


_WRITERS = {Format.DSML: _dsml, Format.GLM: _glm, Format.HERMES: _hermes, Format.DSV3: _dsv3}
