"""One vector checked the way every grammar is: the expected message, then the same events for
every chunking of the real tokenizer's ids and (coalesced) for a one-character-per-token
tokenization of the same text."""
from __future__ import annotations

import random

from pdserve.parsers import Event, ParserOptions, aggregate

from tests.parsers.harness import char_tokenization, normalized, run, splits
from tests.parsers.realtok import Model


def outcome(events: list[Event]) -> tuple:
    """(reasoning, content, calls, invalid calls, finish, diagnostics) of an event stream."""
    agg = aggregate(events)
    calls = [(c.name, c.arguments, c.complete) for c in agg.tool_calls]
    invalid = [(c.name, c.text, c.reason) for c in agg.invalid_calls]
    finish = agg.finish_reason.value if agg.finish_reason else None
    return agg.reasoning, agg.content, calls, invalid, finish, [d.code.value for d in agg.diagnostics]


def check(model: Model, name: str, text: str, options: ParserOptions, length: bool = False) -> tuple:
    """The outcome of `text`, after checking that no chunking or tokenization changes it."""
    ids = model.encode(text)
    events = run(model, ids, options, length=length)
    rng = random.Random(name)
    for cuts in splits(len(ids), rng, three_way_max=16, randoms=12, two_way_max=24):
        assert run(model, ids, options, cuts, length) == events, cuts
    per_char = char_tokenization(model, text)
    for cuts in splits(len(per_char), rng, two_way_max=12, three_way_max=0, randoms=6):
        assert normalized(run(model, per_char, options, cuts, length)) == normalized(events), cuts
    return outcome(events)
