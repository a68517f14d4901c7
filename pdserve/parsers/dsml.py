"""DeepSeek V3.2 / V4 DSML output parser at the token-id level (docs/dsml.md, "The parser").

The DSML id is the only anchor. The `<`/`</` in front of it is recognised from the held bytes
of the current region (it is often fused into the previous token: ` <`, `}</`, `.</`), and the
tag header is lexed from bytes up to `>`. Nothing that belongs to a tag ever reaches content
or reasoning, whatever the request's tool settings.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from pdserve.parsers.arguments import Arguments, Mode
from pdserve.parsers.base import Pending, StreamParser
from pdserve.parsers.calls import valid_json
from pdserve.parsers.dsml_header import MAX_TAG_BYTES, Tag, TagKind, ValueKind, lex_header
from pdserve.parsers.dsml_route import Action, State, route
from pdserve.parsers.events import Diag
from pdserve.parsers.options import ParserOptions
from pdserve.parsers.profiles import Profile
from pdserve.parsers.text import DSML_TEXT_HOLD, VALUE_HOLD, WS, TextChannels, Utf8Sink, held_suffix, json_escape


_MODES = {ValueKind.STRING: Mode.STRING, ValueKind.JSON: Mode.JSON, ValueKind.AUTO: Mode.AUTO}


@dataclass
class _Param:
    name: str
    value: ValueKind
    discard: bool  # duplicate name: parsed and swallowed, the first one wins
    streamed: bool = False  # sent as a JSON string as it arrives; else buffered until the closer
    sink: Utf8Sink = field(default_factory=Utf8Sink)
    raw: bytearray = field(default_factory=bytearray)


@dataclass
class _Call:
    args: Arguments
    names: set[str] = field(default_factory=set)
    body_done: bool = False    # a JSON body gave the whole arguments object
    body_failed: bool = False  # a JSON body did not parse: the call is reported invalid
    body_text: str = ""


def _opener(hold: bytes) -> tuple[bool, int] | None:
    """(closing, separator newlines) when `hold` ends with `</` or `<`."""
    if hold.endswith(b"</"):
        return True, 0
    if hold.endswith(b"<"):
        return False, 0
    return None


class DsmlParser(StreamParser):
    def __init__(self, profile: Profile, options: ParserOptions) -> None:
        super().__init__(profile, options)
        if profile.dsml is None:
            raise ValueError(f"profile {profile.name} has no DSML marker")
        self._dsml = profile.dsml.dsml
        self._block = profile.dsml.block_name
        self._think = (profile.think.start, profile.think.end) if profile.think else (-1, -1)
        reasoning = options.start_in_reasoning and profile.think is not None
        self._text = TextChannels(self._out, DSML_TEXT_HOLD, options.separate_reasoning, reasoning)
        self._state = State.TEXT
        self._block_seen = False
        self._hdr = bytearray()           # TAG: header bytes so far
        self._tag_closing = False
        self._tag_return = State.TEXT     # the region the tag was opened from
        self._tag_sep = False             # `\n\n` stood before the opener
        self._tag_newlines = 0            # how many separator newlines stood before it
        self._gap_hold = b""              # BLOCK/INVOKE: a `<` or `</` that may open a tag
        self._gap_ws = bytearray()        # strict: the whitespace between two tags
        self._gap_dirty = False           # lenient: stray text in this gap was reported
        self._val_hold = b""              # PARAM/JSONBODY: a `<` or `</` that may open a tag
        self._call: _Call | None = None
        self._param: _Param | None = None
        self._body = bytearray()

    def pending(self) -> Pending:
        text = self._text.held() if self._state is State.TEXT else 0
        value = len(self._val_hold) + len(self._gap_hold)
        utf8 = max(self._text.utf8_held(), self._param.sink.held() if self._param else 0)
        return Pending(text, value, utf8)

    # ---- ids ------------------------------------------------------------------------------------

    def _on_id(self, token_id: int) -> None:
        if token_id == self._dsml:
            self._on_dsml()
        elif token_id in self._think and self._state is State.TAG:
            self._abandon_tag("a think marker inside a tag header")
            if not self._failed:
                self._on_id(token_id)
        elif token_id in self._think and self._state not in (State.PARAM, State.JSONBODY):
            self._on_think(token_id == self._think[0])
        else:  # think ids inside a value are literal text: `<think>` in a value is that id
            self._on_bytes(self._bytes(token_id))

    def _on_think(self, start: bool) -> None:
        if self._state is State.TEXT:
            diag = self._text.think(start, self._block_seen)
            if diag is not None:
                self._diag(diag, "<think>" if start else "</think>")
        else:
            self._gap_hold = b""  # a held `<` followed by a marker is not an opener
            self._gap_stray("a think marker between tags")

    def _on_dsml(self) -> None:
        if self._state is State.TAG:
            hdr = bytes(self._hdr)
            self._abandon_tag("a DSML id inside a tag header")
            found = None if self._failed else _opener(hdr)
        elif self._state is State.TEXT:
            found = self._text.take_opener()
        elif self._state in (State.BLOCK, State.INVOKE):
            found, self._gap_hold = _opener(self._gap_hold), b""
        else:
            found, self._val_hold = _opener(self._val_hold), b""
        if self._failed:
            return
        if found is None:
            self._reject(Diag.BARE_DSML)
            return
        self._tag_return, self._tag_closing, self._tag_sep = self._state, found[0], found[1] == 2
        self._tag_newlines = found[1]
        self._hdr.clear()
        self._state = State.TAG

    def _abandon_tag(self, why: str) -> None:
        self._reject(Diag.UNFINISHED_TAG, why)
        self._hdr.clear()
        self._state = self._tag_return

    # ---- bytes ----------------------------------------------------------------------------------

    def _on_bytes(self, data: bytes) -> None:
        while data and not self._failed:
            state = self._state
            if state is State.TEXT:
                self._text_bytes(data)
                return
            if state is State.TAG:
                data = self._tag_bytes(data)
            elif state in (State.BLOCK, State.INVOKE):
                data = self._gap_bytes(data)
            else:
                self._value_bytes(data)
                return

    def _text_bytes(self, data: bytes) -> None:
        if self.options.strict and self._block_seen and not self._text.reasoning:
            self._fail(Diag.TEXT_AFTER_BLOCK, "text after the tool-call block")
            return
        self._text.push(data)

    def _tag_bytes(self, data: bytes) -> bytes:
        room = MAX_TAG_BYTES - len(self._hdr)
        end = data.find(b">")
        if 0 <= end <= room:
            self._hdr += data[:end]
            self._dispatch_tag()
            return data[end + 1:]
        if end < 0 and len(data) <= room:
            self._hdr += data
            return b""
        back = bytes(self._hdr) + data  # not a tag after all: the bytes go back to the region
        self._hdr.clear()
        self._state = self._tag_return
        self._reject(Diag.TAG_OVERFLOW, f"no '>' within {MAX_TAG_BYTES} bytes")
        return b"" if self._failed else back

    def _gap_bytes(self, data: bytes) -> bytes:
        buf, self._gap_hold = self._gap_hold + data, b""
        for i, byte in enumerate(buf):
            if byte in WS:
                if self.options.strict:
                    self._gap_ws.append(byte)
                continue
            rest = buf[i:]
            if rest in (b"<", b"</"):
                self._gap_hold = rest
                return b""
            call = self._call
            if (byte == 0x7B and self._state is State.INVOKE and call is not None and not call.names
                    and not call.body_done and not call.body_failed and not self.options.strict):
                self._state = State.JSONBODY
                self._body.clear()
                return rest
            self._gap_stray(f"text in {self._state.value}")
            if self._failed:
                return b""
        return b""

    def _gap_stray(self, detail: str) -> None:
        if self.options.strict:
            self._fail(Diag.TEXT_BETWEEN_TAGS, detail)
        elif not self._gap_dirty:
            self._gap_dirty = True
            self._diag(Diag.TEXT_BETWEEN_TAGS, detail)

    def _value_bytes(self, data: bytes) -> None:
        buf = self._val_hold + data
        keep = held_suffix(buf, VALUE_HOLD)
        self._val_hold, out = buf[len(buf) - keep:], buf[:len(buf) - keep]
        if not out:
            return
        if self._state is State.JSONBODY:
            self._body += out
            return
        param = self._param
        if param is None or param.discard:
            return
        if param.streamed:
            self._calls.args(json_escape(param.sink.push(out)))
        else:
            param.raw += out

    # ---- tags -----------------------------------------------------------------------------------

    def _dispatch_tag(self) -> None:
        strict = self.options.strict
        tag = lex_header(bytes(self._hdr), self._tag_closing, self._block, strict)
        self._hdr.clear()
        self._state = self._tag_return
        while not self._failed:
            action = route(self._state, tag, strict, self._text.reasoning)
            code = Diag.UNKNOWN_TAG if tag.kind is TagKind.UNKNOWN else Diag.STRAY_MARKER
            if action is Action.FAIL:
                self._fail(code, f"{tag.describe()} in {self._state.value}")
            elif strict and self._state in (State.BLOCK, State.INVOKE) and not self._gap_ok(tag):
                self._fail(Diag.TEXT_BETWEEN_TAGS, f"gap {bytes(self._gap_ws)!r} before {tag.describe()}")
            elif action is Action.DROP:
                self._diag(code, f"{tag.describe()} in {self._state.value}")
            else:
                self._apply(action, tag)
            if not action.reroutes:
                break
        self._gap_ws.clear()
        self._gap_dirty = False

    def _gap_ok(self, tag: Tag) -> bool:
        gap = bytes(self._gap_ws)
        if gap == b"\n":
            return True
        empty_invoke = self._state is State.INVOKE and self._call is not None and not self._call.names
        return gap == b"\n\n" and empty_invoke and tag.kind is TagKind.INVOKE and tag.closing

    def _apply(self, action: Action, tag: Tag) -> None:
        if action in (Action.OPEN_BLOCK, Action.IMPLICIT_BLOCK):
            self._open_block(implicit=action is Action.IMPLICIT_BLOCK)
        elif action is Action.START_CALL:
            self._calls.start(tag.name)
            self._call = _Call(Arguments(self._calls, self.options, tag.name, self._diag))
            self._state = State.INVOKE
        elif action is Action.END_BLOCK:
            self._state = State.TEXT
            self._text.after_block()
        elif action is Action.START_PARAM:
            self._start_param(tag)
        elif action in (Action.END_CALL, Action.IMPLICIT_END_CALL):
            if action is Action.IMPLICIT_END_CALL:
                self._diag(Diag.CLOSED_IMPLICITLY, f"</invoke> before {tag.describe()}")
            self._end_call()
        elif action in (Action.END_PARAM, Action.IMPLICIT_END_PARAM):
            if action is Action.IMPLICIT_END_PARAM:
                self._diag(Diag.CLOSED_IMPLICITLY, f"</parameter> before {tag.describe()}")
            self._end_param()
        elif action is Action.END_BODY:
            if not (tag.kind is TagKind.INVOKE and tag.closing):
                self._diag(Diag.CLOSED_IMPLICITLY, f"JSON body before {tag.describe()}")
            self._end_body()

    def _open_block(self, implicit: bool) -> None:
        text = self._text
        if text.reasoning:  # strict already failed in route()
            self._diag(Diag.REASONING_CLOSED_IMPLICITLY)
            text.release()
            text.close()
            text.reasoning = False
        elif self.options.strict and self._block_seen:
            self._fail(Diag.TEXT_AFTER_BLOCK)
            return
        elif not self._tag_sep and not implicit:
            self._diag(Diag.NO_SEPARATOR)  # strict too: the peers' outputs often lack the blank line
        text.release()
        text.before_call(self._tag_newlines)
        text.close()
        if implicit:
            self._diag(Diag.IMPLICIT_BLOCK)
        text.lstrip = b""
        self._block_seen = True
        self._state = State.BLOCK

    def _start_param(self, tag: Tag) -> None:
        call = self._call
        assert call is not None  # route() only starts parameters in INVOKE
        discard = tag.name in call.names or call.body_done or call.body_failed
        if discard:
            self._reject(Diag.DUPLICATE_PARAMETER, tag.name)
            if self._failed:
                return
        else:
            call.names.add(tag.name)
        streamed = not discard and call.args.begin(tag.name, _MODES[tag.value])
        self._param = _Param(tag.name, tag.value, discard, streamed)
        self._state = State.PARAM

    def _end_param(self) -> None:
        param, self._param = self._param, None
        self._state = State.INVOKE
        call = self._call
        if param is None or param.discard or call is None:
            return
        if param.streamed:
            self._calls.args(json_escape(param.sink.close()) + '"')
            return
        text = bytes(param.raw).decode("utf-8", "replace")
        if call.args.end(param.name, _MODES[param.value], text):
            return
        self._reject(Diag.VALUE_NOT_JSON, param.name)
        if not self._failed:
            call.args.end_as_string(param.name, text)

    def _end_body(self) -> None:
        self._state = State.INVOKE
        call = self._call
        text = bytes(self._body).decode("utf-8", "replace").strip()
        self._body.clear()
        if call is None:
            return
        try:
            is_object = isinstance(json.loads(text), dict) and valid_json(text)
        except ValueError:
            is_object = False
        if is_object:
            self._calls.args(text)
            call.body_done = True
        else:
            self._diag(Diag.INVALID_JSON_BODY, text[:64])
            call.body_failed = True
            call.body_text = text

    def _end_call(self) -> None:
        call, self._call = self._call, None
        self._state = State.BLOCK
        if call is None:
            return
        if call.body_failed:
            self._calls.invalid(Diag.INVALID_JSON_BODY, call.body_text)
            return
        if not call.body_done:
            call.args.close()
        self._calls.end(complete=True)

    # ---- end of stream --------------------------------------------------------------------------

    def _on_finish(self) -> None:
        if self._state is State.TAG:
            self._diag(Diag.UNFINISHED_TAG, "the stream ended inside a tag header")
            self._hdr.clear()
            self._state = self._tag_return
        if self._state is State.TEXT:
            text = self._text
            if self._block_seen and not text.reasoning and not text.pend.strip(WS):
                text.pend = b""  # trailing whitespace after a block is dropped
            text.release()
            text.close()
            return
        call = self._call
        if self._state is State.JSONBODY and call is not None:
            self._body += self._val_hold
            self._end_body()
        self._gap_hold = self._val_hold = b""
        if self._state is State.INVOKE and call is not None and not call.body_failed:
            self._call = None  # every value was closed: the arguments are complete
            if not call.body_done:
                call.args.close()
            self._end_call_at_finish()
            return
        if self._state is State.BLOCK:  # the calls ended; only </function_calls> is missing
            self._diag(Diag.ENDED_INSIDE_BLOCK, "block")
            return
        self._diag(Diag.ENDED_INSIDE_BLOCK, self._state.value)
        param, self._param = self._param, None
        if param is not None and not param.discard and param.streamed:
            self._calls.args(json_escape(param.sink.close()))  # no closing quote is invented
        elif param is not None and not param.discard and call is not None:
            call.args.cut(param.name, _MODES[param.value], bytes(param.raw).decode("utf-8", "replace"))
        elif call is not None:
            call.args.flush()
        self._call = None
        self._end_cut_call(call.body_text if call is not None else "")
