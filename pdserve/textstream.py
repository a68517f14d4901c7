"""Token ids → text deltas, with stop strings cut out (shared by the engine's LLM API and the router).

Text that could be the start of a stop string is held back until it is known not to be one, so
a stop string never reaches the client, not even in part (unless it is asked for: vLLM's
``include_stop_str_in_output``, where the text ends with it).
"""
from __future__ import annotations

from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStrings:
    """Cuts text at the first stop string to end; holds back only what could still begin one.
    `include`: the text ends after the stop string instead of before it."""

    def __init__(self, stop: list[str] | tuple[str, ...] = (), include: bool = False) -> None:
        self._stop = [s for s in stop if s]
        self._include = include
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> str:
        """More text; what of it can go out now."""
        if self.stopped or not self._stop:
            return "" if self.stopped else text
        buf = self._pending + text
        # The stop string that ends first (of two ending together, the longer): the one a stream
        # meets first, so the cut does not depend on how the text was chunked.
        found = [(i + len(s), -len(s), s) for s in self._stop if (i := buf.find(s)) >= 0]
        if found:
            end, minus_len, self.matched = min(found)
            self.stopped, self._pending = True, ""
            return buf[:end if self._include else end + minus_len]
        keep = min(self._hold, len(buf))
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def release(self) -> str:
        """The text run ended (a tool call or reasoning follows, or the stream ended): what was
        held back goes out."""
        pending, self._pending = self._pending, ""
        return pending


class TextStream:
    """Feed token ids with `push`; get text deltas; `stopped` once a stop string was seen."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | tuple[str, ...] = (),
                 skip_special_tokens: bool = True, include_stop: bool = False):
        # special tokens (<|im_end|>, EOS) are markup, not text: never printed, as over HTTP
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stops = StopStrings(stop, include_stop)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched

    def push(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        return self._stops.push(self._detok.push(ids))

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self._stops.push(self._detok.flush())
        return text if self.stopped else text + self._stops.release()
