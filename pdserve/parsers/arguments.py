"""One call's arguments object built parameter by parameter (DSML and GLM share it).

The request's tool schema decides a value's JSON type (typed.py); a parameter whose string
value must be converted is buffered until its closer instead of streamed, so streaming still
equals non-streaming. A lone `arguments` or `input` parameter that the tool's schema does not
list, holding a JSON object, is unwrapped into the arguments themselves (a repair vLLM makes
too): it is buffered until a second parameter or the end of the call decides.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from enum import Enum

from pdserve.parsers.calls import ArgsJoiner, CallEmitter, valid_json
from pdserve.parsers.events import Diag
from pdserve.parsers.options import ParserOptions
from pdserve.parsers.typed import CONVERTIBLE, convert, wants_conversion

UNWRAP_NAMES = ("arguments", "input")


class Mode(Enum):
    STRING = "string"  # the model wrote a string (DSML string="true"; GLM with a typed schema)
    JSON = "json"      # the model wrote JSON (DSML string="false")
    AUTO = "auto"      # unknown: JSON if it parses to a non-string, else a string


class Arguments:
    def __init__(self, calls: CallEmitter, options: ParserOptions, tool: str,
                 diag: Callable[[Diag, str], None]) -> None:
        self._calls = calls
        self._tool = tool
        self._schema = options.tool_schema(tool)
        self._diag = diag
        self._joiner = ArgsJoiner()
        self._count = 0
        self._unwrap: tuple[str, str] | None = None  # (key, literal) of a lone-parameter candidate

    def begin(self, key: str, mode: Mode) -> bool:
        """A parameter starts; True when its value streams as a JSON string (the caller then
        sends the escaped text as it arrives), False when the caller buffers it for `end`."""
        self._flush_unwrap()
        self._count += 1
        if self._unwrap_candidate(key):
            return False
        schema = self._schema.get(key) if self._schema is not None else None
        if mode is Mode.STRING and not wants_conversion(schema):
            self._calls.args(self._joiner.key(key) + '"')
            return True
        return False

    def end(self, key: str, mode: Mode, text: str) -> bool:
        """A buffered parameter's value is complete; False when `mode` is JSON and `text` is not
        JSON (the caller decides between a failure and a string)."""
        literal = self._literal(key, mode, text)
        if literal is None:
            return False
        if self._count == 1 and self._unwrap_candidate(key):
            self._unwrap = (key, literal)
        else:
            self._calls.args(self._joiner.key(key) + literal)
        return True

    def end_as_string(self, key: str, text: str) -> None:
        """A JSON value that did not parse, kept as a string (lenient)."""
        self._calls.args(self._joiner.key(key) + json.dumps(text, ensure_ascii=False))

    def close(self) -> None:
        """The call ends with its arguments complete: the closing `}` (or the unwrapped object)."""
        if self._unwrap is not None:
            key, literal = self._unwrap
            self._unwrap = None
            if isinstance(json.loads(literal), dict):
                self._diag(Diag.ARGUMENTS_UNWRAPPED, f"{self._tool}.{key}")
                self._calls.args(literal)
                return
            self._calls.args(self._joiner.key(key) + literal)
        self._calls.args(self._joiner.close())

    def cut(self, key: str, mode: Mode, text: str) -> None:
        """The output ended inside a buffered value: send what the model wrote of it (a JSON
        value as it is, anything else as an unterminated string), so nothing is lost."""
        self._flush_unwrap()
        body = text if mode is Mode.JSON else '"' + json.dumps(text, ensure_ascii=False)[1:-1]
        self._calls.args(self._joiner.key(key) + body)

    def flush(self) -> None:
        """The output ended between values: send a held lone parameter as it is."""
        self._flush_unwrap()

    def _unwrap_candidate(self, key: str) -> bool:
        return (self._count == 1 and key in UNWRAP_NAMES and self._schema is not None
                and key not in self._schema)

    def _flush_unwrap(self) -> None:
        if self._unwrap is not None:
            key, literal = self._unwrap
            self._unwrap = None
            self._calls.args(self._joiner.key(key) + literal)

    def _literal(self, key: str, mode: Mode, text: str) -> str | None:
        schema = self._schema.get(key) if self._schema is not None else None
        where = f"{self._tool}.{key}"
        if mode is Mode.JSON:
            if not valid_json(text):
                return None
            value = json.loads(text)
            if not (isinstance(value, str) and schema is not None and schema.kind in CONVERTIBLE):
                return text.strip()
            mode, text = Mode.STRING, value  # a JSON string where the schema wants another type
        if schema is not None and schema.kind is not None:
            conv = convert(text, schema)
            if conv.converted:
                self._diag(Diag.VALUE_CONVERTED, f"{where}: {'null' if conv.literal == 'null' else schema.kind}")
            elif conv.failed:
                self._diag(Diag.VALUE_NOT_CONVERTED, f"{where}: not {schema.kind}")
            return conv.literal
        if mode is Mode.STRING:
            return json.dumps(text, ensure_ascii=False)
        if valid_json(text) and not isinstance(json.loads(text), str):  # AUTO without a type
            return text.strip()
        return json.dumps(text, ensure_ascii=False)
