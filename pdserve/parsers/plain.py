"""Models without a tool-call grammar: reasoning markers (if any) and content."""
from __future__ import annotations

from pdserve.parsers.base import Pending, StreamParser
from pdserve.parsers.options import ParserOptions
from pdserve.parsers.profiles import Profile
from pdserve.parsers.text import TextChannels


class PlainParser(StreamParser):
    def __init__(self, profile: Profile, options: ParserOptions) -> None:
        super().__init__(profile, options)
        self._think = (profile.think.start, profile.think.end) if profile.think else (-1, -1)
        reasoning = options.start_in_reasoning and profile.think is not None
        self._text = TextChannels(self._out, None, options.separate_reasoning, reasoning)

    def pending(self) -> Pending:
        return Pending(self._text.held(), 0, self._text.utf8_held())

    def _on_id(self, token_id: int) -> None:
        if token_id in self._think:
            start = token_id == self._think[0]
            diag = self._text.think(start, block_seen=False)
            if diag is not None:
                self._diag(diag, "<think>" if start else "</think>")
        else:
            self._text.push(self._bytes(token_id))

    def _on_finish(self) -> None:
        self._text.release()
        self._text.close()
