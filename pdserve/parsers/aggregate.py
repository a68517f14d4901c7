"""Folding events into a response: the non-streaming message is the aggregate of the stream.

Used by the API for non-streaming responses and by tests to check streaming == non-streaming.
`coalesce` merges adjacent deltas of one kind, which is also how one `feed()`'s events become
one SSE chunk without reordering anything.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.parsers.events import (ContentDelta, Diagnostic, Event, Finish, FinishReason, InvalidCall,
                                    ReasoningDelta, ToolCallArgs, ToolCallEnd, ToolCallStart)


@dataclass
class CallResult:
    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class Aggregate:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[CallResult] = field(default_factory=list)
    invalid_calls: list[InvalidCall] = field(default_factory=list)  # reported, never returned as calls
    diagnostics: list[Diagnostic] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def failed(self) -> bool:
        return any(d.fatal for d in self.diagnostics)

    def add(self, events: Iterable[Event]) -> Aggregate:
        for ev in events:
            if isinstance(ev, ContentDelta):
                self.content += ev.text
            elif isinstance(ev, ReasoningDelta):
                self.reasoning += ev.text
            elif isinstance(ev, ToolCallStart):
                self.tool_calls.append(CallResult(ev.index, ev.id, ev.name))
            elif isinstance(ev, ToolCallArgs):
                self._call(ev.index).arguments += ev.fragment
            elif isinstance(ev, ToolCallEnd):
                self._call(ev.index).complete = ev.complete
            elif isinstance(ev, InvalidCall):
                if ev.index is not None:  # its start was streamed: the non-streaming answer drops it
                    self.tool_calls.remove(self._call(ev.index))
                self.invalid_calls.append(ev)
            elif isinstance(ev, Diagnostic):
                self.diagnostics.append(ev)
            elif isinstance(ev, Finish):
                self.finish_reason = ev.reason
        return self

    def _call(self, index: int) -> CallResult:
        for call in reversed(self.tool_calls):
            if call.index == index:
                return call
        raise KeyError(f"tool call {index} was never started")


def aggregate(events: Iterable[Event]) -> Aggregate:
    return Aggregate().add(events)


def coalesce(events: Iterable[Event]) -> list[Event]:
    """Merge adjacent content, reasoning and same-index argument deltas; keep everything else."""
    out: list[Event] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + ev.text)
        elif isinstance(ev, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + ev.text)
        elif isinstance(ev, ToolCallArgs) and isinstance(last, ToolCallArgs) and last.index == ev.index:
            out[-1] = ToolCallArgs(ev.index, last.fragment + ev.fragment)
        else:
            out.append(ev)
    return out
