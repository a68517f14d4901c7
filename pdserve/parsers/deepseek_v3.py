"""DeepSeek V3 / R1 and V3.1 tool calls; every marker is one id (docs/tool-calls.md §5).

    V3, R1:  <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
    V3.1:    <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>

One call follows another inside <｜tool▁calls▁begin｜> … <｜tool▁calls▁end｜>.

ARGS is one JSON object written by the model. It streams as it arrives once the name is known
(V3.1 at the separator, V3 at the newline after the name); the call is complete only when ARGS
parses as a JSON object at `<｜tool▁call▁end｜>`, otherwise it is reported as invalid.
"""
from __future__ import annotations

import json
import re
from enum import Enum

from pdserve.parsers.base import Pending, StreamParser
from pdserve.parsers.calls import valid_json
from pdserve.parsers.events import Diag
from pdserve.parsers.options import ParserOptions
from pdserve.parsers.profiles import Profile
from pdserve.parsers.text import NEWLINE_HOLD, WS, TextChannels, Utf8Sink, held_suffix

FENCE_OPEN = b"```json\n"
FENCE_CLOSE = b"\n```"
FENCE_HOLD = re.compile(rb"\n?`{0,3}\Z")  # a suffix that may be the start of the closing fence


class State(Enum):
    TEXT = "text"
    BLOCK = "block"  # between calls, inside <｜tool▁calls▁begin｜>
    HEAD = "head"    # after <｜tool▁call▁begin｜>: the type (V3) or the name (V3.1)
    NAME = "name"    # V3: after the separator, up to the newline
    FENCE = "fence"  # V3: the ```json line
    ARGS = "args"


class Mark(Enum):
    CALLS_BEGIN = "calls_begin"
    CALLS_END = "calls_end"
    CALL_BEGIN = "call_begin"
    CALL_END = "call_end"
    SEP = "sep"


class DeepSeekV3Parser(StreamParser):
    def __init__(self, profile: Profile, options: ParserOptions) -> None:
        super().__init__(profile, options)
        d = profile.dsv3
        if d is None:
            raise ValueError(f"profile {profile.name} has no DeepSeek V3 tool markers")
        self._marks = {d.calls_begin: Mark.CALLS_BEGIN, d.calls_end: Mark.CALLS_END, d.call_begin: Mark.CALL_BEGIN,
                       d.call_end: Mark.CALL_END, d.sep: Mark.SEP}
        self._fenced = d.fenced
        self._think = (profile.think.start, profile.think.end) if profile.think else (-1, -1)
        reasoning = options.start_in_reasoning and profile.think is not None
        # Think markers keep their newlines, as in DSML: DeepSeek's reasoning is returned as written.
        self._text = TextChannels(self._out, NEWLINE_HOLD, options.separate_reasoning, reasoning)
        self._state = State.TEXT
        self._block_seen = False
        self._buf = bytearray()    # HEAD, NAME, FENCE: bytes so far
        self._args = bytearray()   # ARGS: every byte released to the call so far
        self._hold = b""           # ARGS (V3): a suffix that may be the closing fence
        self._sink = Utf8Sink()
        self._gap_dirty = False

    def pending(self) -> Pending:
        return Pending(self._text.held(), len(self._hold), max(self._text.utf8_held(), self._sink.held()))

    # ---- ids ------------------------------------------------------------------------------------

    def _on_id(self, token_id: int) -> None:
        mark = self._marks.get(token_id)
        if mark is not None:
            self._on_mark(mark)
        elif token_id in self._think and self._state is State.TEXT:
            start = token_id == self._think[0]
            diag = self._text.think(start, self._block_seen)
            if diag is not None:
                self._diag(diag, "<think>" if start else "</think>")
        else:  # think ids inside a call are literal text
            self._on_bytes(self._bytes(token_id))

    def _on_mark(self, mark: Mark) -> None:
        state = self._state
        if state is State.TEXT:
            if mark is Mark.CALLS_BEGIN:
                self._open_block()
            elif mark is Mark.CALL_BEGIN:  # a call without the block marker
                self._reject(Diag.IMPLICIT_BLOCK)
                if not self._failed:
                    self._open_block()
                    self._begin_call()
            else:
                self._text.release()
                self._reject(Diag.STRAY_MARKER, f"{mark.value} in text")
        elif state is State.BLOCK:
            if mark is Mark.CALL_BEGIN:
                self._begin_call()
            elif mark is Mark.CALLS_END:
                self._state = State.TEXT
                self._text.after_block()
            else:
                self._reject(Diag.STRAY_MARKER, f"{mark.value} between calls")
        elif mark is Mark.SEP and state is State.HEAD:
            self._on_sep()
        elif mark is Mark.CALL_END and state is State.ARGS:
            self._end_call()
        else:  # the call is cut short by another marker: end or report it, then route the marker again
            self._reject(Diag.CLOSED_IMPLICITLY, f"{mark.value} in {state.value}")
            if self._failed:
                return
            if not (state is State.ARGS and self._end_if_complete()):
                self._abandon_call(Diag.INVALID_CALL)
            self._state = State.BLOCK
            if mark is not Mark.CALL_END:
                self._on_mark(mark)

    def _open_block(self) -> None:
        text = self._text
        if text.reasoning:
            self._reject(Diag.REASONING_CLOSED_IMPLICITLY)
            if self._failed:
                return
        elif self.options.strict and self._block_seen:
            self._fail(Diag.TEXT_AFTER_BLOCK, "a second block of calls")
            return
        text.end_before_call()
        self._block_seen = True
        self._gap_dirty = False
        self._state = State.BLOCK

    def _begin_call(self) -> None:
        self._buf.clear()
        self._args.clear()
        self._hold = b""
        self._state = State.HEAD

    # ---- bytes ----------------------------------------------------------------------------------

    def _on_bytes(self, data: bytes) -> None:
        state = self._state
        if state is State.TEXT:
            if self.options.strict and self._block_seen and not self._text.reasoning:
                self._fail(Diag.TEXT_AFTER_BLOCK, "text after the tool calls")
                return
            self._text.push(data)
        elif state is State.BLOCK:
            if data.strip(WS) and not self._gap_dirty:
                self._gap_dirty = True
                self._reject(Diag.TEXT_BETWEEN_TAGS, "text between calls")
        elif state in (State.HEAD, State.NAME):
            self._buf += data
            if state is State.NAME and b"\n" in self._buf:
                name, _, rest = bytes(self._buf).partition(b"\n")
                self._start(name)
                self._buf.clear()
                self._state = State.FENCE
                if rest:
                    self._on_bytes(rest)
        elif state is State.FENCE:
            self._buf += data
            if FENCE_OPEN.startswith(bytes(self._buf)):
                return
            if self._buf.startswith(FENCE_OPEN):
                rest = bytes(self._buf[len(FENCE_OPEN):])
            else:  # no ```json line: the bytes are the arguments themselves
                self._reject(Diag.MISSING_FENCE, "no ```json before the arguments")
                if self._failed:
                    return
                rest = bytes(self._buf)
            self._buf.clear()
            self._state = State.ARGS
            self._on_bytes(rest)
        else:
            self._args_bytes(data)

    def _args_bytes(self, data: bytes) -> None:
        if not self._args and not self._hold:
            data = data.lstrip(WS)
        buf = self._hold + data
        keep = held_suffix(buf, FENCE_HOLD) if self._fenced else 0
        self._hold, out = buf[len(buf) - keep:], buf[:len(buf) - keep]
        if out:
            self._args += out
            self._calls.args(self._sink.push(out))

    # ---- calls ----------------------------------------------------------------------------------

    def _on_sep(self) -> None:
        head = bytes(self._buf).decode("utf-8", "replace").strip()
        self._buf.clear()
        if self._fenced:
            if head != "function":
                self._reject(Diag.INVALID_CALL, f"call type {head!r}")
                if self._failed:
                    return
            self._state = State.NAME
        else:
            self._start(head.encode("utf-8"))
            self._state = State.ARGS

    def _start(self, raw_name: bytes) -> None:
        name = raw_name.decode("utf-8", "replace").strip()
        self._sink = Utf8Sink()
        if not name:
            self._reject(Diag.INVALID_CALL, "empty function name")
            return
        self._calls.start(name)

    def _candidate(self) -> tuple[str, bytes]:
        """(the arguments if they ended now, the held bytes that belong to them)."""
        hold = b"" if self._fenced and self._hold.strip(WS) == b"```" else self._hold
        return bytes(self._args + hold).decode("utf-8", "replace"), hold

    def _release_args(self, hold: bytes) -> None:
        self._hold = b""
        if hold:
            self._args += hold
        self._calls.args(self._sink.push(hold) + self._sink.close())

    def _end_if_complete(self) -> bool:
        """Without <｜tool▁call▁end｜>: end the call as complete if its arguments are."""
        text, hold = self._candidate()
        if not _is_object(text):
            return False
        self._release_args(hold)
        self._calls.end(complete=True)
        return True

    def _end_call(self) -> None:
        self._state = State.BLOCK
        self._gap_dirty = False
        text, hold = self._candidate()
        if self._fenced and hold == self._hold and (hold or self._args):
            self._reject(Diag.MISSING_FENCE, "no ``` after the arguments")
            if self._failed:
                return
        self._release_args(hold)
        if _is_object(text):
            self._calls.end(complete=True)
            return
        self._reject(Diag.INVALID_CALL, f"arguments are not a JSON object: {text[:64]!r}")
        if not self._failed:
            self._calls.invalid(Diag.INVALID_CALL)

    def _abandon_call(self, reason: Diag) -> None:
        if self._state is State.ARGS:
            self._release_args(self._hold)
        if self._calls.open:
            self._calls.invalid(reason)
        elif self._buf:
            self._calls.report(bytes(self._buf).decode("utf-8", "replace").strip(), "", reason)
        self._buf.clear()

    def _on_finish(self) -> None:
        state = self._state
        if state is State.TEXT:
            text = self._text
            if self._block_seen and not text.reasoning and not text.pend.strip(WS):
                text.pend = b""  # trailing newlines after calls are dropped, as in every grammar
            text.release()
            text.close()
            return
        if state is State.BLOCK:
            self._diag(Diag.ENDED_INSIDE_BLOCK, "block")
            return
        if state is State.ARGS:
            text, hold = self._candidate()
            if _is_object(text):
                self._release_args(hold)
                self._end_call_at_finish()
                return
            self._release_args(self._hold)
        self._diag(Diag.ENDED_INSIDE_BLOCK, state.value)
        if self._calls.open:
            self._end_cut_call()
        elif self._buf:
            self._calls.report(bytes(self._buf).decode("utf-8", "replace").strip(), "", Diag.ENDED_INSIDE_BLOCK)


def _is_object(text: str) -> bool:
    return valid_json(text) and isinstance(json.loads(text), dict)
