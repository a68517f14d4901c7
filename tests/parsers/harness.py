"""Running a parser over an id sequence under many chunkings and tokenizations (spec §2.10)."""
from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from functools import lru_cache

from pdserve.parsers import Event, ParserOptions, StreamParser, coalesce, make_parser

from tests.parsers.realtok import Model, load_model


def run(model: Model, ids: Sequence[int], options: ParserOptions, cuts: Sequence[int] = (),
        length: bool = False) -> list[Event]:
    """Feed `ids` split at `cuts` (sorted positions), then finish."""
    parser = make_parser(model.profile, options)
    events: list[Event] = []
    start = 0
    for cut in [*cuts, len(ids)]:
        events += parser.feed(ids[start:cut])
        start = cut
    return events + parser.finish(length=length)


def run_tracking(model: Model, ids: Sequence[int], options: ParserOptions,
                 length: bool = False) -> tuple[list[Event], list[tuple[int, int, int]]]:
    """One id per feed; also the parser's pending (text, value, utf8) after each id."""
    parser: StreamParser = make_parser(model.profile, options)
    events: list[Event] = []
    pending = []
    for token_id in ids:
        events += parser.feed([token_id])
        pending.append(tuple(parser.pending()))
    return events + parser.finish(length=length), pending


def splits(n: int, rng: random.Random, three_way_max: int = 40, randoms: int = 30,
           two_way_max: int | None = None) -> Iterator[tuple[int, ...]]:
    """No split, every 2-way split, every 3-way split (n ≤ three_way_max), uniform 1/2/3/5, and
    random splits. `two_way_max` samples the 2-way positions evenly for long inputs."""
    yield ()
    positions = range(1, n)
    if two_way_max is not None and n - 1 > two_way_max:
        positions = sorted({1 + (i * (n - 2)) // (two_way_max - 1) for i in range(two_way_max)})
    for i in positions:
        yield (i,)
    if n <= three_way_max:
        for i in range(1, n):
            for j in range(i + 1, n):
                yield (i, j)
    for size in (1, 2, 3, 5):
        yield tuple(range(size, n, size))
    for _ in range(randoms):
        k = rng.randint(1, max(1, min(n - 1, 12)))
        yield tuple(sorted(rng.sample(range(1, n), k))) if n > 1 else ()


def char_tokenization(model: Model, text: str) -> list[int]:
    """Every character encoded on its own; added tokens (markers, control tokens) stay single
    ids, as the tokenizer splits them out before BPE (spec P3)."""
    ids: list[int] = []
    added, pattern = _added(model.key)
    for part in pattern.split(text):
        if not part:
            continue
        token_id = added.get(part)
        if token_id is not None:
            ids.append(token_id)
            continue
        for ch in part:
            ids += model.encode(ch)
    assert byte_string(model, ids) == byte_string(model, model.encode(text)), "same bytes, other grouping"
    return ids


def byte_string(model: Model, ids: Sequence[int]) -> bytes:
    return b"".join(model.vocab.token_bytes(i) for i in ids)


@lru_cache(maxsize=None)
def _added(model_key: str) -> tuple[dict[str, int], re.Pattern[str]]:
    added = {t.content: i for i, t in load_model(model_key).tok.get_added_tokens_decoder().items()}
    pattern = re.compile("(" + "|".join(re.escape(c) for c in sorted(added, key=len, reverse=True)) + ")")
    return added, pattern


def normalized(events: Sequence[Event]) -> list[Event]:
    """Events with adjacent deltas merged: what must not depend on the tokenization."""
    return coalesce(events)
