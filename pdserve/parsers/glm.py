"""GLM-4.5 … GLM-5 tool calls: `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>…</tool_call>`.

All six tags are single ids, so the grammar is a small state machine over marker ids; bytes
only matter inside the name, keys and values. String values are written raw by the chat
template, so a value's JSON type comes from the request's tool schema when there is one
(arguments.py); without one, a value that parses as non-string JSON is taken as that JSON.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pdserve.parsers.arguments import Arguments, Mode
from pdserve.parsers.base import Pending, StreamParser
from pdserve.parsers.events import Diag
from pdserve.parsers.options import ParserOptions
from pdserve.parsers.profiles import Profile
from pdserve.parsers.text import NEWLINE_HOLD, WS, TextChannels, Utf8Sink, json_escape


class State(Enum):
    TEXT = "text"
    NAME = "name"    # after <tool_call>, up to the first <arg_key> or </tool_call>
    ARGS = "args"    # between arguments
    KEY = "key"
    VALUE = "value"


class Mark(Enum):
    CALL_OPEN = "<tool_call>"
    CALL_CLOSE = "</tool_call>"
    KEY_OPEN = "<arg_key>"
    KEY_CLOSE = "</arg_key>"
    VALUE_OPEN = "<arg_value>"
    VALUE_CLOSE = "</arg_value>"


class Action(Enum):
    START_CALL = "start_call"
    BEGIN_KEY = "begin_key"
    END_KEY = "end_key"
    BEGIN_VALUE = "begin_value"
    END_VALUE = "end_value"
    END_CALL = "end_call"
    CLOSE = "close"                    # end what is open (the name), then re-route
    IMPLICIT_CLOSE = "implicit_close"  # lenient: a closer is missing; end what is open, re-route
    DROP = "drop"
    FAIL = "fail"


def route(state: State, mark: Mark, strict: bool) -> Action:
    """The GLM marker transition table; CLOSE and IMPLICIT_CLOSE leave the marker to re-route."""
    implicit = Action.FAIL if strict else Action.IMPLICIT_CLOSE
    stray = Action.FAIL if strict else Action.DROP
    table: dict[State, dict[Mark, Action]] = {
        State.TEXT: {Mark.CALL_OPEN: Action.START_CALL},
        State.NAME: {Mark.KEY_OPEN: Action.CLOSE, Mark.CALL_CLOSE: Action.CLOSE, Mark.CALL_OPEN: implicit},
        State.ARGS: {Mark.KEY_OPEN: Action.BEGIN_KEY, Mark.VALUE_OPEN: Action.BEGIN_VALUE,
                     Mark.CALL_CLOSE: Action.END_CALL, Mark.CALL_OPEN: implicit},
        State.KEY: {Mark.KEY_CLOSE: Action.END_KEY, Mark.KEY_OPEN: implicit, Mark.VALUE_OPEN: implicit,
                    Mark.CALL_CLOSE: implicit, Mark.CALL_OPEN: implicit},
        State.VALUE: {Mark.VALUE_CLOSE: Action.END_VALUE, Mark.KEY_OPEN: implicit,
                      Mark.CALL_CLOSE: implicit, Mark.CALL_OPEN: implicit},
    }
    return table[state].get(mark, stray)


@dataclass
class _Value:
    key: str
    mode: Mode         # STRING when the schema types the parameter, else AUTO
    discard: bool
    streamed: bool     # sent as a JSON string as it arrives; else buffered until </arg_value>
    sink: Utf8Sink = field(default_factory=Utf8Sink)
    raw: bytearray = field(default_factory=bytearray)


class GlmParser(StreamParser):
    def __init__(self, profile: Profile, options: ParserOptions) -> None:
        super().__init__(profile, options)
        g = profile.glm
        if g is None:
            raise ValueError(f"profile {profile.name} has no GLM markers")
        self._marks = {g.call_open: Mark.CALL_OPEN, g.call_close: Mark.CALL_CLOSE, g.key_open: Mark.KEY_OPEN,
                       g.key_close: Mark.KEY_CLOSE, g.value_open: Mark.VALUE_OPEN, g.value_close: Mark.VALUE_CLOSE}
        self._think = (profile.think.start, profile.think.end) if profile.think else (-1, -1)
        reasoning = options.start_in_reasoning and profile.think is not None
        self._text = TextChannels(self._out, NEWLINE_HOLD, options.separate_reasoning, reasoning,
                                  trim_think=True)
        self._state = State.TEXT
        self._block_seen = False
        self._buf = bytearray()       # the name or the key being read
        self._name = ""
        self._key: str | None = None  # a key read, waiting for its value
        self._keys: set[str] = set()
        self._args: Arguments | None = None
        self._value: _Value | None = None
        self._gap_dirty = False

    def pending(self) -> Pending:
        value = self._value.sink.held() if self._value else 0
        return Pending(self._text.held(), 0, max(self._text.utf8_held(), value))

    def _on_id(self, token_id: int) -> None:
        mark = self._marks.get(token_id)
        if mark is not None:
            self._on_mark(mark)
        elif token_id in self._think and self._state is not State.VALUE:
            start = token_id == self._think[0]
            if self._state is State.TEXT:
                diag = self._text.think(start, self._block_seen)
                if diag is not None:
                    self._diag(diag, "<think>" if start else "</think>")
            else:
                self._reject(Diag.STRAY_THINK, f"in {self._state.value}")
        else:
            self._on_bytes(self._bytes(token_id))

    def _on_bytes(self, data: bytes) -> None:
        state = self._state
        if state is State.TEXT:
            self._text.push(data)
        elif state in (State.NAME, State.KEY):
            self._buf += data
        elif state is State.ARGS:
            if data.strip(WS) and not self._gap_dirty:
                self._gap_dirty = True
                self._reject(Diag.TEXT_BETWEEN_TAGS, "text between arguments")
        else:
            self._value_bytes(data)

    def _on_mark(self, mark: Mark) -> None:
        while not self._failed:
            action = route(self._state, mark, self.options.strict)
            if action is Action.FAIL:
                self._fail(Diag.STRAY_MARKER, f"{mark.value} in {self._state.value}")
            elif action is Action.DROP:
                if self._state is State.TEXT:
                    self._text.release()
                self._diag(Diag.STRAY_MARKER, f"{mark.value} in {self._state.value}")
            else:
                self._apply(action, mark)
            if action not in (Action.CLOSE, Action.IMPLICIT_CLOSE):
                return

    def _apply(self, action: Action, mark: Mark) -> None:
        if action is Action.IMPLICIT_CLOSE:
            self._diag(Diag.CLOSED_IMPLICITLY, f"{self._state.value} before {mark.value}")
        if action is Action.START_CALL:
            self._start_call()
        elif action is Action.CLOSE or (action is Action.IMPLICIT_CLOSE and self._state is State.NAME):
            self._end_name()
        elif action is Action.BEGIN_KEY:
            if self._key is not None:
                self._reject(Diag.INVALID_CALL, f"key {self._key!r} without a value")
            self._key = None
            self._buf.clear()
            self._state = State.KEY
        elif action is Action.END_KEY or (action is Action.IMPLICIT_CLOSE and self._state is State.KEY):
            self._key = bytes(self._buf).decode("utf-8", "replace").strip()
            self._buf.clear()
            self._state = State.ARGS
        elif action is Action.BEGIN_VALUE:
            self._begin_value()
        elif action is Action.END_VALUE or (action is Action.IMPLICIT_CLOSE and self._state is State.VALUE):
            self._end_value()
        elif action is Action.END_CALL or (action is Action.IMPLICIT_CLOSE and self._state is State.ARGS):
            self._end_call()

    def _start_call(self) -> None:
        text = self._text
        if text.reasoning:
            self._reject(Diag.REASONING_CLOSED_IMPLICITLY)
            if self._failed:
                return
        text.end_before_call()
        self._block_seen = True
        self._buf.clear()
        self._state = State.NAME

    def _end_name(self) -> None:
        self._name = bytes(self._buf).decode("utf-8", "replace").strip()
        self._buf.clear()
        self._keys, self._key, self._gap_dirty = set(), None, False
        self._args = Arguments(self._calls, self.options, self._name, self._diag)
        self._state = State.ARGS
        if self._name:
            self._calls.start(self._name)
        else:
            self._reject(Diag.INVALID_CALL, "empty function name")

    def _begin_value(self) -> None:
        key, self._key = self._key, None
        discard = key is None or key in self._keys
        if discard:
            self._reject(Diag.DUPLICATE_PARAMETER if key else Diag.INVALID_CALL, key or "value without a key")
            if self._failed:
                return
        else:
            self._keys.add(key)  # type: ignore[arg-type]
        schema = self.options.param_schema(self._name, key or "")
        mode = Mode.STRING if schema is not None and schema.kind is not None else Mode.AUTO
        streamed = not discard and self._args is not None and self._args.begin(key or "", mode)
        self._value = _Value(key or "", mode, discard, streamed)
        self._state = State.VALUE

    def _value_bytes(self, data: bytes) -> None:
        value = self._value
        if value is None or value.discard:
            return
        if value.streamed:
            self._calls.args(json_escape(value.sink.push(data)))
        else:
            value.raw += data

    def _end_value(self) -> None:
        value, self._value = self._value, None
        self._state = State.ARGS
        self._gap_dirty = False
        if value is None or value.discard:
            return
        if value.streamed:
            self._calls.args(json_escape(value.sink.close()) + '"')
        elif self._args is not None:
            self._args.end(value.key, value.mode, bytes(value.raw).decode("utf-8", "replace"))

    def _end_call(self) -> None:
        self._state = State.TEXT
        self._text.after_block()
        if self._key is not None:
            self._reject(Diag.INVALID_CALL, f"key {self._key!r} without a value")
            self._key = None
            if self._failed:
                return
        if self._calls.open and self._args is not None:
            self._args.close()
            self._calls.end(complete=True)

    def _on_finish(self) -> None:
        if self._state is State.TEXT:
            text = self._text
            if self._block_seen and not text.reasoning and not text.pend.strip(WS):
                text.pend = b""
            text.release()
            text.close()
            return
        if self._state is State.ARGS and self._key is None and self._calls.open and self._args is not None:
            self._args.close()  # every value was closed: the arguments are complete
            self._end_call_at_finish()
            return
        self._diag(Diag.ENDED_INSIDE_BLOCK, self._state.value)
        if self._state is State.NAME:  # the name may be cut: nothing was sent, report it
            self._calls.report(bytes(self._buf).decode("utf-8", "replace").strip(), "", Diag.ENDED_INSIDE_BLOCK)
            return
        value, self._value = self._value, None
        if value is not None and not value.discard and value.streamed:
            self._calls.args(json_escape(value.sink.close()))
        elif value is not None and not value.discard and self._args is not None:
            self._args.cut(value.key, value.mode, bytes(value.raw).decode("utf-8", "replace"))
        elif self._args is not None:
            self._args.flush()
        self._end_cut_call()
