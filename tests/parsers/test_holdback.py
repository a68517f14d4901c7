"""Spec §2.6 / P5: text is withheld from the caller only while it may still be markup.

Measured two ways: the parser's own account of pending bytes after every id, and from outside,
as the distance between the bytes fed and the content released.
"""
from __future__ import annotations

import random

from pdserve.parsers import ContentDelta, ParserOptions, make_parser

from tests.parsers.harness import char_tokenization, run_tracking
from tests.parsers.realtok import Model, load_model
from tests.parsers.vectors import VECTORS

TEXT_MAX, VALUE_MAX, UTF8_MAX = 4, 2, 3  # spec §2.6 and §2.3
PROSE = ["a", "b", " ", "\n", "\n\n", "<", "</", ">", "x<y", "。", "😀", "é", "北京", "div", "\t"]


def measure(model: Model, ids: list[int], options: ParserOptions, length: bool = False) -> tuple[int, int, int]:
    _, pending = run_tracking(model, ids, options, length)
    return tuple(max((p[k] for p in pending), default=0) for k in range(3))  # type: ignore[return-value]


def test_holdback_over_all_vectors_and_random_outputs_is_within_the_spec_bound() -> None:
    worst = [0, 0, 0]
    for vector in VECTORS:
        model = load_model("deepseek-v4" if vector.model == "v4" else "deepseek-v3.2")
        for ids in (model.encode(vector.text), char_tokenization(model, vector.text)):
            worst = [max(a, b) for a, b in zip(worst, measure(model, ids, vector.options, vector.length))]
    rng = random.Random(5)
    v32 = load_model("deepseek-v3.2")
    for _ in range(500):
        text = "".join(rng.choice(PROSE) for _ in range(rng.randint(1, 40)))
        worst = [max(a, b) for a, b in zip(worst, measure(v32, char_tokenization(v32, text), ParserOptions()))]
    assert worst[0] == TEXT_MAX and worst[1] == VALUE_MAX and worst[2] == UTF8_MAX


def test_content_lags_the_input_by_at_most_the_holdback_plus_one_code_point() -> None:
    """Black box: after each id, the content released is a prefix of the prose fed, short of it
    by ≤ 4 bytes of possible markup plus ≤ 3 bytes of an unfinished UTF-8 character."""
    v32 = load_model("deepseek-v3.2")
    rng = random.Random(11)
    worst = 0
    for _ in range(500):
        text = "".join(rng.choice(PROSE) for _ in range(rng.randint(1, 40)))
        parser = make_parser(v32.profile, ParserOptions())
        fed, released = b"", b""
        for token_id in char_tokenization(v32, text):
            fed += v32.vocab.token_bytes(token_id)
            released += b"".join(e.text.encode() for e in parser.feed([token_id]) if isinstance(e, ContentDelta))
            assert fed.startswith(released)
            worst = max(worst, len(fed) - len(released))
        released += b"".join(e.text.encode() for e in parser.finish() if isinstance(e, ContentDelta))
        assert released == text.encode()
    assert worst <= TEXT_MAX + UTF8_MAX
    assert worst >= TEXT_MAX  # `\n\n</` is reached: the bound is tight
