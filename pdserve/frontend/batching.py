"""Stream batching: up to N tokens of one choice per SSE event.

The first token of a choice always goes out alone (time to first token is not traded away),
then tokens are grouped N at a time; the end of the choice flushes what is left. Output is
decoded (parsed) token by token before batching, so a batch is the concatenation of its tokens'
deltas and the aggregate is the same for every N.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.frontend.output import OutputDelta, TokenLogprob


@dataclass
class Batch:
    delta: OutputDelta = field(default_factory=OutputDelta)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, token_id: int | None, delta: OutputDelta, logprob: TokenLogprob | None) -> None:
        self.delta.extend(delta)  # in place: a non-streaming choice is one batch of every token
        if token_id is not None:
            self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)

    def __bool__(self) -> bool:
        return bool(self.delta) or bool(self.token_ids)


class DeltaBatcher:
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("batch size must be >= 1")
        self.size = size
        self._batch = Batch()
        self._sent_first = False

    def add(self, token_id: int, delta: OutputDelta, logprob: TokenLogprob | None = None) -> Batch | None:
        """Add one token's delta; return a batch when one is due."""
        self._batch.add(token_id, delta, logprob)
        if not self._sent_first or len(self._batch.token_ids) >= self.size:
            self._sent_first = True
            return self.take()
        return None

    def add_text(self, delta: OutputDelta) -> None:
        """Text without a token (the decoder's final flush)."""
        self._batch.add(None, delta, None)

    def take(self) -> Batch:
        batch, self._batch = self._batch, Batch()
        return batch
