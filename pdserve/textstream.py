"""Token ids → text deltas, with stop strings cut out (shared by the engine's LLM API and the router).

Text that could be the start of a stop string is held back until it is known not to be one, so
a stop string never reaches the client, not even in part.
"""
from __future__ import annotations

from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """Feed token ids with `push`; get text deltas; `stopped` once a stop string was seen."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | tuple[str, ...] = (),
                 skip_special_tokens: bool = True):
        # special tokens (<|im_end|>, EOS) are markup, not text: never printed, as over HTTP
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        return self._emit(self._detok.push(ids), final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self._detok.flush(), final=True)

    def _emit(self, text: str, final: bool) -> str:
        buf = self._pending + text
        cut = min((i for i in (buf.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        keep = 0 if final else min(self._hold, len(buf))
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]
