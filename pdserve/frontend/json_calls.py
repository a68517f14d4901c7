"""Tool calls of a model without a call syntax of its own, written as grammar-constrained JSON.

With ``tool_choice`` "required" or a named function, the router constrains such a model's
output to ``{"name":…,"arguments":{…}}`` (a list of them for parallel "required" calls;
``pdserve.structured.spec.tool_call_schema``). The grammar writes compact JSON with the keys in
that order, so the decoder reads the document as it arrives, as the call-syntax parsers do:

* a call starts (``ToolCallStart``) as soon as its name's string closes;
* its arguments stream as the model writes them, raw (the fragments concatenate to the
  JSON text the model wrote);
* it ends complete at its object's ``}``; ``finish_reason`` is "tool_calls" once the whole
  document closed.

An output cut by ``max_tokens`` ends like any cut call (docs/tool-calls.md): a started call is
returned as far as it got, with ``finish_reason`` "length"; a call cut inside its name is
reported (``InvalidCall``), never returned. Nothing of the JSON ever reaches ``content``.

With ``tool_choice`` "auto" and a JSON ``response_format`` the grammar is the union of that
call document and the answer (``tools.ToolPolicy.call_grammar``), and ``CallOrAnswerDecoder``
holds the output back until its opening tells which one the model writes: a call document
opens with ``{"name":"<a tool>","arguments":`` (``[`` first for parallel calls), which an
answer in any other shape cannot.
"""
from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from enum import Enum

from pdserve.frontend.output import OutputDecoder, OutputDelta, Part
from pdserve.parsers import Diag, InvalidCall, ToolCallArgs, ToolCallEnd, ToolCallStart
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

_NAME_KEY = '"name":'
_ARGS_KEY = ',"arguments":'


class _At(Enum):
    """Where the reader is in the document."""

    START = "start"        # nothing read: `[` (a list of calls) or `{` (one call)
    CALL = "call"          # in a list: the next call's `{`
    NAME_KEY = "name_key"  # the literal `"name":`
    NAME = "name"          # the name's string literal
    ARGS_KEY = "args_key"  # the literal `,"arguments":`
    ARGS = "args"          # the arguments, up to the call object's `}`
    AFTER = "after"        # in a list, after a call: `,` or `]`
    DONE = "done"          # the document closed
    BROKEN = "broken"      # text the grammar should not have allowed; the rest is reported


class JsonCallReader:
    """Reads a grammar-constrained JSON call document piece by piece into call events."""

    def __init__(self) -> None:
        self._at = _At.START
        self._list = False
        self._literal = 0           # characters of the expected literal matched so far
        self._name = ""             # the name's literal as read so far, opening quote included
        self._function = ""         # the open call's name, once its literal closed
        self._index = -1            # the open call's index: calls started so far - 1
        self._raw: list[str] = []   # for a report: the open call's text, its arguments once they began
        self._depth = 0             # brackets open inside the arguments
        self._in_string = self._escaped = False
        self._broken_open = False   # the document broke inside a started call

    @property
    def done(self) -> bool:
        return self._at is _At.DONE

    def feed(self, text: str) -> list[Part]:
        out: list[Part] = []
        run = 0 if self._at is _At.ARGS else -1  # where this piece's argument text starts
        for i, ch in enumerate(text):
            if self._at is _At.BROKEN:
                self._raw.append(text[i:])
                break
            self._raw.append(ch)
            if self._at is _At.ARGS:
                if self._argument_char(ch):
                    continue
                if i > run:
                    out.append(ToolCallArgs(self._index, text[run:i]))
                run = -1
                out.append(ToolCallEnd(self._index, True))
                self._at = _At.AFTER if self._list else _At.DONE
                self._raw, self._name = [], ""
            elif not self._step(ch, out):
                self._broken_open = self._at is _At.ARGS_KEY
                self._at = _At.BROKEN
            elif self._at is _At.ARGS:
                run = i + 1
        if self._at is _At.ARGS and 0 <= run < len(text):
            out.append(ToolCallArgs(self._index, text[run:]))
        return out

    def end(self, reason: str) -> list[Part]:
        """The output ended (`reason`: "length" or "stop"): what that leaves of the open call."""
        at, text = self._at, "".join(self._raw)
        if at in (_At.ARGS_KEY, _At.ARGS):  # a started call is returned as far as a length cut left it
            if reason == "length":
                return [ToolCallEnd(self._index, False)]
            return [ToolCallEnd(self._index, False),
                    InvalidCall(self._index, self._function, text, Diag.ENDED_INSIDE_BLOCK.value)]
        if at in (_At.NAME_KEY, _At.NAME):  # nothing of it was sent
            why = Diag.TRUNCATED_CALL_DROPPED if reason == "length" else Diag.ENDED_INSIDE_BLOCK
            return [InvalidCall(None, self._name[1:], text, why.value)]
        if at is _At.BROKEN:
            if self._broken_open:
                return [ToolCallEnd(self._index, False),
                        InvalidCall(self._index, self._function, text, Diag.INVALID_CALL.value)]
            return [InvalidCall(None, self._name[1:], text, Diag.INVALID_CALL.value)]
        return []

    def _step(self, ch: str, out: list[Part]) -> bool:
        """One character outside the arguments; False when the document cannot go on with it."""
        at = self._at
        if at is _At.START and ch == "[":
            self._list, self._at, self._raw = True, _At.CALL, []
        elif at in (_At.START, _At.CALL) and ch == "{":
            self._at, self._raw, self._literal, self._name = _At.NAME_KEY, ["{"], 0, ""
        elif at is _At.NAME_KEY and ch == _NAME_KEY[self._literal]:
            self._literal += 1
            if self._literal == len(_NAME_KEY):
                self._at = _At.NAME
        elif at is _At.NAME and (self._name or ch == '"'):
            self._name += ch
            if len(self._name) > 1 and not self._string_char(ch):  # the name's closing quote
                self._index += 1
                self._function = json.loads(self._name)
                out.append(ToolCallStart(self._index, f"call_{secrets.token_hex(12)}", self._function))
                self._at, self._literal = _At.ARGS_KEY, 0
        elif at is _At.ARGS_KEY and ch == _ARGS_KEY[self._literal]:
            self._literal += 1
            if self._literal == len(_ARGS_KEY):
                self._at, self._depth, self._raw = _At.ARGS, 0, []
        elif at is _At.AFTER and ch in ",]":
            self._at = _At.CALL if ch == "," else _At.DONE
        else:
            return False
        return True

    def _string_char(self, ch: str) -> bool:
        """Inside a string literal whose opening quote was read: False when `ch` closes it."""
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            return False
        return True

    def _argument_char(self, ch: str) -> bool:
        """False when `ch` is the call object's `}`, which ends the arguments."""
        if self._in_string:
            self._in_string = self._string_char(ch)
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            if self._depth == 0:
                return False
            self._depth -= 1
        return True


class JsonCallDecoder:
    """An ``OutputDecoder`` (frontend/output.py) for grammar-constrained JSON calls."""

    stopped = False  # stop strings do not apply inside a call
    stop_sequence = None

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._text = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self._reader = JsonCallReader()
        self.finish_reason: str | None = None

    def push(self, token_id: int) -> OutputDelta:
        return OutputDelta(parts=self._reader.feed(self._text.push(token_id)))

    def finish(self, reason: str = "stop") -> OutputDelta:
        parts = self._reader.feed(self._text.flush())
        parts += self._reader.end(reason)
        self.finish_reason = "tool_calls" if self._reader.done else reason
        return OutputDelta(parts=parts)


def call_openers(names: Iterable[str], parallel: bool) -> list[str]:
    """How a JSON call document of these tools opens, up to its first call's arguments."""
    head = "[" if parallel else ""
    return [f'{head}{{{_NAME_KEY}{json.dumps(name, ensure_ascii=False)}{_ARGS_KEY}' for name in names]


class CallOrAnswerDecoder:
    """An ``OutputDecoder`` for a JSON call document or an answer in a response_format: the
    tokens are held until the text either opens a call document (``call_openers``) or can no
    longer open one, then replayed into the decoder of that kind, which reads the rest."""

    def __init__(self, tokenizer: Tokenizer, openers: list[str], answer: OutputDecoder) -> None:
        self._text = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self._openers = openers
        self._calls = JsonCallDecoder(tokenizer)
        self._answer = answer
        self._seen = ""
        self._held: list[int] = []
        self._chosen: OutputDecoder | None = None
        self.finish_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self._chosen is not None and self._chosen.stopped

    @property
    def stop_sequence(self) -> str | None:
        return self._chosen.stop_sequence if self._chosen is not None else None

    def push(self, token_id: int) -> OutputDelta:
        if self._chosen is not None:
            return self._chosen.push(token_id)
        self._held.append(token_id)
        self._seen += self._text.push(token_id)
        if any(self._seen.startswith(o) for o in self._openers):
            return self._choose(self._calls)
        if any(o.startswith(self._seen) for o in self._openers):
            return OutputDelta()  # still the opening of a call document, or of an answer
        return self._choose(self._answer)

    def finish(self, reason: str = "stop") -> OutputDelta:
        delta = self._choose(self._answer) if self._chosen is None else OutputDelta()
        assert self._chosen is not None
        delta.extend(self._chosen.finish(reason))
        self.finish_reason = self._chosen.finish_reason
        return delta

    def _choose(self, decoder: OutputDecoder) -> OutputDelta:
        self._chosen, held, self._held = decoder, self._held, []
        delta = OutputDelta()
        for token_id in held:
            delta.extend(decoder.push(token_id))
        return delta
