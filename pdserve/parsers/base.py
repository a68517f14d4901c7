"""The streaming parser interface: ids in, events out, one token at a time.

Everything common to the grammars lives here: end-of-output ids finish the stream, control ids
vanish, a strict failure stops parsing, and the finish reason is decided in one place.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import NamedTuple

from pdserve.parsers.calls import CallEmitter
from pdserve.parsers.events import Diag, Diagnostic, Event, Finish, FinishReason
from pdserve.parsers.options import ParserOptions
from pdserve.parsers.profiles import Profile


class Pending(NamedTuple):
    """Bytes withheld from the caller right now (spec §2.6, P5)."""

    text: int   # reasoning/content hold-back, ≤ 4 for DSML, ≤ 2 for GLM/Hermes
    value: int  # argument value hold-back, ≤ 2
    utf8: int   # unfinished code point in a sink, ≤ 3


class StreamParser(ABC):
    def __init__(self, profile: Profile, options: ParserOptions) -> None:
        self.profile = profile
        self.options = options
        self._out: list[Event] = []
        self._bytes = profile.vocab.token_bytes
        self._eos = profile.eos_ids | options.stop_ids
        self._drop = profile.drop_ids - self._eos
        self._calls = CallEmitter(self._out, options)
        self._finished = False
        self._failed = False
        self._length = False  # the stream is being finished by the token limit

    def feed(self, ids: Iterable[int]) -> list[Event]:
        """Consume ids; return the events they produced (possibly none)."""
        for token_id in ids:
            if self._finished:
                break
            if token_id in self._eos:
                self._finish(length=False)
            elif self._failed or token_id in self._drop:
                continue
            else:
                self._on_id(token_id)
        return self._drain()

    def finish(self, length: bool = False) -> list[Event]:
        """End of stream without an end-of-output id; `length` when max_tokens cut it."""
        if not self._finished:
            self._finish(length)
        return self._drain()

    @property
    def done(self) -> bool:
        return self._finished

    @abstractmethod
    def pending(self) -> Pending:
        """How many bytes are withheld right now (for the hold-back bound and metrics)."""

    @abstractmethod
    def _on_id(self, token_id: int) -> None: ...

    @abstractmethod
    def _on_finish(self) -> None:
        """Release or drop what is held; end an open call as incomplete."""

    def _diag(self, code: Diag, detail: str = "") -> None:
        self._out.append(Diagnostic(code, detail))

    def _fail(self, code: Diag, detail: str = "") -> None:
        """Strict mode: the first deviation ends parsing; an open call ends incomplete."""
        self._out.append(Diagnostic(code, detail, fatal=True))
        self._calls.abort()
        self._failed = True

    def _reject(self, code: Diag, detail: str = "") -> None:
        """A deviation: fatal in strict mode, a diagnostic otherwise."""
        if self.options.strict:
            self._fail(code, detail)
        else:
            self._diag(code, detail)

    def _end_cut_call(self, tail: str = "") -> None:
        """The output ended inside a call whose arguments are not complete (docs/tool-calls.md
        §2): cut by the token limit it ends incomplete; otherwise it is reported, not returned."""
        if not self._calls.open:
            return
        if self._length:
            self._calls.end(complete=False)
        else:
            self._calls.invalid(Diag.ENDED_INSIDE_BLOCK, tail)

    def _end_call_at_finish(self) -> None:
        """The output ended inside a call whose arguments are complete: it is returned."""
        self._diag(Diag.CALL_CLOSED_AT_END, self._calls.name)
        self._calls.end(complete=True)

    def _finish(self, length: bool) -> None:
        self._length = length
        if not self._failed:
            self._on_finish()
        self._finished = True
        if self._failed:
            reason = FinishReason.ERROR
        elif length:
            reason = FinishReason.LENGTH
        elif self._calls.complete:
            reason = FinishReason.TOOL_CALLS
        else:
            reason = FinishReason.STOP
        self._out.append(Finish(reason))

    def _drain(self) -> list[Event]:
        out = list(self._out)
        self._out.clear()
        return out
