"""Tool-call emission shared by all grammars: indices, ids, suppression, atomic buffering.

The grammar parsers say what they saw (a call started, an argument fragment, the call ended);
this class decides what the caller is told, so `tools_mode`, `parallel_tool_calls`, the
incremental/atomic choice and invalid calls behave the same for every grammar.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from pdserve.parsers.events import Diag, Diagnostic, Event, InvalidCall, ToolCallArgs, ToolCallEnd, ToolCallStart
from pdserve.parsers.options import Emission, ParserOptions, ToolsMode


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def valid_json(text: str) -> bool:
    """Strict JSON (no NaN/Infinity), as the arguments string must be."""
    try:
        json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return False
    return True


def json_key(key: str) -> str:
    return json.dumps(key, ensure_ascii=False)


@dataclass
class ArgsJoiner:
    """Builds `{"k": v, "k2": v2}` piecewise, with the reference decoder's separators."""

    opened: bool = False

    def key(self, name: str) -> str:
        prefix = ", " if self.opened else "{"
        self.opened = True
        return f"{prefix}{json_key(name)}: "

    def close(self) -> str:
        return "}" if self.opened else "{}"


@dataclass
class _OpenCall:
    name: str
    accepted: bool
    index: int = -1
    fragments: list[str] = field(default_factory=list)  # every argument fragment so far


class CallEmitter:
    def __init__(self, out: list[Event], options: ParserOptions) -> None:
        self._out = out
        self._opts = options
        self._next_index = 0
        self._accepted = 0
        self.complete = 0  # complete calls emitted; decides finish_reason "tool_calls"
        self._call: _OpenCall | None = None

    @property
    def open(self) -> bool:
        return self._call is not None

    def start(self, name: str) -> bool:
        """Open a call; False when it is swallowed (suppressed, over max_calls, unknown)."""
        opts = self._opts
        reason = None
        if opts.tools_mode is ToolsMode.SUPPRESS:
            reason = Diag.SUPPRESSED
        elif opts.max_calls is not None and self._accepted >= opts.max_calls:
            reason = Diag.MAX_CALLS
        elif opts.drop_unknown_tools and opts.known_tools is not None and name not in opts.known_tools:
            reason = Diag.UNKNOWN_TOOL
        if reason is not None:
            self._out.append(Diagnostic(reason, name))
            self._call = _OpenCall(name, accepted=False)
            return False
        self._accepted += 1
        self._call = _OpenCall(name, accepted=True)
        if opts.emission_mode is Emission.INCREMENTAL:
            self._call.index = self._take_index()
            self._out.append(ToolCallStart(self._call.index, self._call_id(self._call.index), name))
        return True

    @property
    def name(self) -> str:
        return self._call.name if self._call is not None else ""

    @property
    def arguments(self) -> str:
        """The open call's arguments as emitted (or buffered) so far."""
        return "".join(self._call.fragments) if self._call is not None else ""

    def args(self, fragment: str) -> None:
        call = self._call
        if call is None or not call.accepted or not fragment:
            return
        call.fragments.append(fragment)
        if self._opts.emission_mode is Emission.INCREMENTAL:
            self._out.append(ToolCallArgs(call.index, fragment))

    def end(self, complete: bool) -> None:
        call, self._call = self._call, None
        if call is None or not call.accepted:
            return
        if self._opts.emission_mode is Emission.INCREMENTAL:
            self._out.append(ToolCallEnd(call.index, complete))
        elif not complete:
            self._out.append(Diagnostic(Diag.TRUNCATED_CALL_DROPPED, call.name))
            self._out.append(InvalidCall(None, call.name, "".join(call.fragments), Diag.TRUNCATED_CALL_DROPPED.value))
            return
        else:
            index = self._take_index()
            self._out.append(ToolCallStart(index, self._call_id(index), call.name))
            if call.fragments:
                self._out.append(ToolCallArgs(index, "".join(call.fragments)))
            self._out.append(ToolCallEnd(index, True))
        if complete:
            self.complete += 1

    def invalid(self, reason: Diag, tail: str = "") -> None:
        """The open call is not a call (arguments not valid JSON, or cut outside a token limit):
        a started one ends incomplete, and the call is reported with what the model wrote
        (`tail`: text the grammar held that never became a fragment)."""
        call, self._call = self._call, None
        if call is None or not call.accepted:
            return
        text = "".join(call.fragments) + tail
        if self._opts.emission_mode is Emission.INCREMENTAL:
            self._out.append(ToolCallEnd(call.index, False))
            self._out.append(InvalidCall(call.index, call.name, text, reason.value))
        else:
            self._out.append(InvalidCall(None, call.name, text, reason.value))

    def report(self, name: str, text: str, reason: Diag) -> None:
        """A call that never opened (its name is unknown until it is parsed, as in Hermes)."""
        if self._opts.tools_mode is ToolsMode.EMIT:
            self._out.append(InvalidCall(None, name, text, reason.value))

    def abort(self) -> None:
        """A strict failure: an emitted call ends incomplete, a buffered one is discarded."""
        call, self._call = self._call, None
        if call is not None and call.accepted and self._opts.emission_mode is Emission.INCREMENTAL:
            self._out.append(ToolCallEnd(call.index, False))

    def _take_index(self) -> int:
        index, self._next_index = self._next_index, self._next_index + 1
        return index

    def _call_id(self, index: int) -> str:
        return f"{self._opts.call_id_prefix}_{index}"
