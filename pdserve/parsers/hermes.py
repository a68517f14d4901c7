"""Qwen / Hermes tool calls: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.

Both markers are single ids, so only the newline separator in front of `<tool_call>` is held
back in text. A call is emitted when its closing marker arrives: the JSON body cannot be
attributed to a name before it is complete, so this grammar is atomic per call. A body that is
not a call is reported (InvalidCall) with its text, never shown as content.
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
from pdserve.parsers.text import NEWLINE_HOLD, WS, TextChannels

_NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)"')


class State(Enum):
    TEXT = "text"
    CALL = "call"  # collecting the JSON body


class HermesParser(StreamParser):
    def __init__(self, profile: Profile, options: ParserOptions) -> None:
        super().__init__(profile, options)
        if profile.hermes is None:
            raise ValueError(f"profile {profile.name} has no <tool_call> markers")
        self._open, self._close = profile.hermes.call_open, profile.hermes.call_close
        self._think = (profile.think.start, profile.think.end) if profile.think else (-1, -1)
        reasoning = options.start_in_reasoning and profile.think is not None
        self._text = TextChannels(self._out, NEWLINE_HOLD, options.separate_reasoning, reasoning,
                                  trim_think=True)
        self._state = State.TEXT
        self._body = bytearray()
        self._block_seen = False

    def pending(self) -> Pending:
        return Pending(self._text.held(), 0, self._text.utf8_held())

    def _on_id(self, token_id: int) -> None:
        if token_id == self._open:
            self._on_open()
        elif token_id == self._close:
            self._on_close()
        elif self._state is State.CALL:
            self._body += self._bytes(token_id)  # think ids inside the body are literal text
        elif token_id in self._think:
            start = token_id == self._think[0]
            diag = self._text.think(start, self._block_seen)
            if diag is not None:
                self._diag(diag, "<think>" if start else "</think>")
        else:
            self._text.push(self._bytes(token_id))

    def _on_open(self) -> None:
        if self._state is State.CALL:
            body = bytes(self._body).decode("utf-8", "replace").strip()
            self._calls.report(_guess_name(body), body, Diag.INVALID_CALL)
            self._reject(Diag.INVALID_CALL, "<tool_call> inside a call; the unfinished body is reported")
            self._body.clear()
            return
        text = self._text
        if text.reasoning:
            self._reject(Diag.REASONING_CLOSED_IMPLICITLY)
            if self._failed:
                return
        text.end_before_call()
        self._block_seen = True
        self._state = State.CALL
        self._body.clear()

    def _on_close(self) -> None:
        if self._state is not State.CALL:
            self._text.release()
            self._reject(Diag.STRAY_MARKER, "</tool_call>")
            return
        self._state = State.TEXT
        self._text.after_block()
        body = bytes(self._body).decode("utf-8", "replace").strip()
        self._body.clear()
        call = _decode_call(body)
        if call is None:
            self._calls.report(_guess_name(body), body, Diag.INVALID_CALL)
            self._reject(Diag.INVALID_CALL, body[:64])
            return
        name, arguments = call
        self._calls.start(name)
        self._calls.args(arguments)
        self._calls.end(complete=True)

    def _on_finish(self) -> None:
        if self._state is State.CALL:
            body = bytes(self._body).decode("utf-8", "replace").strip()
            call = _decode_call(body)
            if call is not None:  # a complete body without </tool_call>: the call stands
                self._calls.start(call[0])
                self._calls.args(call[1])
                self._end_call_at_finish()
                return
            self._diag(Diag.ENDED_INSIDE_BLOCK, "call")
            self._calls.report(_guess_name(body), body, Diag.ENDED_INSIDE_BLOCK)
            return
        text = self._text
        if self._block_seen and not text.reasoning and not text.pend.strip(WS):
            text.pend = b""
        text.release()
        text.close()


def _guess_name(body: str) -> str:
    m = _NAME.search(body)
    return m.group(1) if m else ""


def _decode_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON string) of a call body, or None if it is not a call object."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            return (obj["name"], args) if valid_json(args) and isinstance(json.loads(args), dict) else None
        except ValueError:
            return None
    if isinstance(args, dict):
        return obj["name"], json.dumps(args, ensure_ascii=False)
    return None
