"""Text channels shared by all parsers: reasoning/content, byte hold-back, UTF-8 sinks.

Bytes are held only while they might still turn out to be markup (`<`, `</`) or the separator
in front of it (`\\n\\n`); everything else is released at once. The hold-back is a function of
the byte stream alone, which is what makes the output independent of how BPE grouped bytes.
"""
from __future__ import annotations

import codecs
import json
import re

from pdserve.parsers.events import ContentDelta, Diag, Event, ReasoningDelta

WS = b" \t\r\n"
# DSML text: the tag opener `<`/`</` with up to two separator newlines in front (≤ 4 bytes).
DSML_TEXT_HOLD = re.compile(rb"\n{0,2}</?\Z|\n{1,2}\Z")
# Values: only the opener, since values are verbatim (≤ 2 bytes).
VALUE_HOLD = re.compile(rb"</?\Z")
# Id-marker grammars (GLM, Hermes): only the newline separator before the marker (≤ 2 bytes).
NEWLINE_HOLD = re.compile(rb"\n{1,2}\Z")


def held_suffix(buf: bytes, pattern: re.Pattern[bytes] | None) -> int:
    """Length of the longest suffix of `buf` that must stay undecided."""
    if pattern is None or not buf:
        return 0
    m = pattern.search(buf, max(0, len(buf) - 4))
    return len(buf) - m.start() if m else 0


def json_escape(text: str) -> str:
    """JSON string body of `text`; per code point, so escaping pieces equals escaping the whole."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def separator(ws: bytes) -> bytes:
    """One separator for a run of white space: a blank line, a newline, a space, or nothing."""
    newlines = min(2, ws.count(b"\n"))
    return b"\n" * newlines if newlines else (b" " if ws else b"")


class Utf8Sink:
    """Incremental UTF-8 decoder: holds at most 3 bytes of an unfinished code point."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, data: bytes) -> str:
        return self._dec.decode(data)

    def close(self) -> str:
        text = self._dec.decode(b"", final=True)
        self._dec.reset()
        return text

    def held(self) -> int:
        return len(self._dec.getstate()[0])


class TextChannels:
    """The reasoning and content channels with their pending (held) bytes."""

    def __init__(self, out: list[Event], hold: re.Pattern[bytes] | None, separate_reasoning: bool,
                 reasoning: bool, trim_think: bool = False) -> None:
        self._out = out
        self._hold = hold
        self._separate = separate_reasoning
        # Templates that write `<think>\n…\n</think>\n\n` (Qwen) or strip around the markers
        # (GLM): those newlines are formatting, not reasoning or content.
        self._trim_think = trim_think
        self.reasoning = reasoning     # which channel text goes to now
        self.pend = b""                # held bytes, always a suffix matched by `hold`
        self.content_started = False   # non-whitespace content was released
        self.lstrip = b"\n" if reasoning and trim_think else b""  # bytes dropped before the next text
        # Around calls (docs/tool-calls.md §3): the newlines in front of a call are formatting;
        # the whitespace after it is held, as one separator (`separator()`), until text resumes,
        # which then gets that separator, or if the model wrote none after the call, the one
        # it wrote before it. Whitespace that no text follows is dropped.
        self.after_call = False
        self.gap = b""
        self.sep = b""
        self._sinks = {True: Utf8Sink(), False: Utf8Sink()}

    def after_block(self) -> None:
        """A call (or block of calls) ended: whitespace is held until text resumes."""
        self.after_call = True
        self.gap = b""

    def push(self, data: bytes) -> None:
        if self.after_call:
            rest = data.lstrip(WS)
            self.gap = separator(self.gap + data[:len(data) - len(rest)])
            if not rest:
                return
            self.after_call = False
            sep = (self.gap or self.sep) if self.content_started and not self.reasoning else b""
            data, self.gap = sep + rest, b""
        if self.lstrip:
            data = data.lstrip(self.lstrip)
            if not data:
                return
            self.lstrip = b""
        buf = self.pend + data
        keep = held_suffix(buf, self._hold)
        self.pend = buf[len(buf) - keep:]
        self._emit(buf[:len(buf) - keep])

    def release(self) -> None:
        """The held bytes turned out to be text (or the stream ended)."""
        pend, self.pend = self.pend, b""
        self._emit(pend.lstrip(self.lstrip) if self.lstrip else pend)

    def take_opener(self) -> tuple[bool, int] | None:
        """Remove a trailing `<`/`</` and up to two newlines before it: (closing, newlines)."""
        pend = self.pend
        if pend.endswith(b"</"):
            closing, pend = True, pend[:-2]
        elif pend.endswith(b"<"):
            closing, pend = False, pend[:-1]
        else:
            return None
        stripped = pend.rstrip(b"\n")
        newlines = min(2, len(pend) - len(stripped))
        self.pend = pend[:len(pend) - newlines]
        self.release()
        return closing, newlines

    def take_newlines(self) -> int:
        """Drop held separator newlines in front of an id marker; return how many there were."""
        count = len(self.pend) - len(self.pend.rstrip(b"\n"))
        self.pend = self.pend[:len(self.pend) - count]
        self.release()
        return count

    def before_call(self, newlines: int) -> None:
        """A call starts after `newlines` separator newlines (already taken from the hold-back)."""
        if not self.after_call:  # calls back to back keep the separator of the first one
            self.sep = separator(b"\n" * newlines) if self.content_started and not self.reasoning else b""
        self.after_call = False
        self.gap = b""

    def close(self) -> None:
        """Flush the current channel's UTF-8 sink (a broken code point becomes U+FFFD)."""
        self._emit_text(self._sinks[self.reasoning].close())

    def end_before_call(self) -> None:
        """A tool call starts: the separator newlines in front of it are formatting, the text
        so far is flushed, and text after the call is content."""
        self.before_call(self.take_newlines())
        self.close()
        self.reasoning = False
        self.lstrip = b""

    def think(self, start: bool, block_seen: bool) -> Diag | None:
        """Apply a think marker (spec §2.5); returns a diagnostic for a stray one."""
        if self.reasoning:
            if start:
                self.release()
                return Diag.STRAY_THINK
            if self._trim_think:
                self.pend = self.pend.rstrip(b"\n")
            self.release()
            self.close()
            self.reasoning = False
            self.lstrip = b"\n" if self._trim_think else b""
            return None
        if start and not self.content_started and not block_seen and not self.pend.strip(WS):
            self.pend = b""
            self.close()
            self.reasoning = True
            self.lstrip = b"\n" if self._trim_think else b""
            return None
        self.release()
        return Diag.STRAY_THINK

    def held(self) -> int:
        return len(self.pend) + len(self.gap)

    def utf8_held(self) -> int:
        return max(sink.held() for sink in self._sinks.values())

    def _emit(self, data: bytes) -> None:
        if data:
            self._emit_text(self._sinks[self.reasoning].push(data))

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        if self.reasoning and self._separate:
            self._out.append(ReasoningDelta(text))
            return
        if not self.reasoning and text.strip():
            self.content_started = True
        self._out.append(ContentDelta(text))
