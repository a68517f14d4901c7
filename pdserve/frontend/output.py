"""Output token ids → deltas for the client: the one hook between decode workers and responses.

Every generated token of a choice goes through an ``OutputDecoder`` one id at a time, so the
text never depends on how the workers or the stream batching chunked the ids. Today the decoder
is plain text (special tokens skipped, stop strings cut by ``TextStream``). The parser issue
replaces ``chat_decoder`` with the token-ID parser (``pdserve.parsers``): its events then fill
``OutputDelta``'s reasoning and tool-call fields, and nothing downstream changes shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.textstream import TextStream
from pdserve.tokenizer import Tokenizer


@dataclass
class OutputDelta:
    """What one or more tokens added to a choice's message."""

    content: str = ""
    # The parser issue adds: reasoning_content: str, tool_calls: list[ToolCallDelta].

    def __bool__(self) -> bool:
        return bool(self.content)

    def merge(self, other: OutputDelta) -> OutputDelta:
        return OutputDelta(self.content + other.content)


class OutputDecoder(Protocol):
    stopped: bool  # a stop condition was met inside the text (the workers must be told to stop)

    def push(self, token_id: int) -> OutputDelta: ...

    def finish(self) -> OutputDelta: ...


class TextDecoder:
    """Plain text: special tokens are skipped, stop strings cut (never sent, not even in part)."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._text = TextStream(tokenizer, stop)

    @property
    def stopped(self) -> bool:
        return self._text.stopped

    def push(self, token_id: int) -> OutputDelta:
        if self._tokenizer.is_special(token_id):
            return OutputDelta()
        return OutputDelta(self._text.push([token_id]))

    def finish(self) -> OutputDelta:
        return OutputDelta(self._text.flush())


def completion_decoder(tokenizer: Tokenizer, stop: list[str]) -> OutputDecoder:
    return TextDecoder(tokenizer, stop)


def chat_decoder(tokenizer: Tokenizer, stop: list[str], request: Any = None) -> OutputDecoder:
    """The chat output path. `request` (tools, tool_choice) is for the token-ID parser to come;
    until then tool markup, if a model printed any, would be plain text, so the default model's
    templates are rendered without tools."""
    return TextDecoder(tokenizer, stop)


@dataclass
class TokenLogprob:
    """One sampled token's logprob and its top alternatives, as a decode worker reports it."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    @staticmethod
    def from_wire(obj: dict[str, Any]) -> TokenLogprob:
        return TokenLogprob(int(obj["token_id"]), float(obj["logprob"]),
                            [(int(t), float(lp)) for t, lp in obj.get("top") or []])
