"""Encoding long texts off the event loop, and the size bound that refuses a text untokenized.

``Tokenizer.encode`` sends long texts through ``encode_batch`` (it releases the GIL; the ids
must be the same), and ``min_tokens`` never exceeds the true token count: it is what lets the
router refuse a multi-megabyte prompt without spending seconds tokenizing it.
"""
from __future__ import annotations

import threading
import time

from hypothesis import given
from hypothesis import strategies as st

from pdserve.tokenizer import _INLINE_ENCODE_CHARS

from tests.tokenizer.test_detokenizer import FRAGMENTS, PROPERTY, any_tokenizer, deepseek, smol  # noqa: F401

WORDS = ["the", " ", "  ", "\n\n", "ünïcödé", "中文", "🎉", "𝐀𝐁", "ﬁ", "1234567", "<|im_end|>",
         "-" * 40, "\t", "Hello", "world", " x"]


@PROPERTY
@given(st.lists(st.sampled_from(WORDS + FRAGMENTS), min_size=1, max_size=400))
def test_long_texts_encode_to_the_same_ids_as_plain_encode(any_tokenizer, words):
    text = "".join(words) * (1 + _INLINE_ENCODE_CHARS // max(1, len("".join(words))))
    assert len(text) > _INLINE_ENCODE_CHARS  # the encode_batch path
    for special in (False, True):
        expected = any_tokenizer._tok.encode(text, add_special_tokens=special).ids
        assert any_tokenizer.encode(text, add_special_tokens=special) == expected


@PROPERTY
@given(st.lists(st.sampled_from(WORDS + FRAGMENTS), min_size=0, max_size=300), st.integers(1, 40))
def test_the_size_bound_never_exceeds_the_token_count(any_tokenizer, words, repeat):
    text = "".join(words) * repeat
    assert any_tokenizer.min_tokens(text) <= len(any_tokenizer.encode(text))


def test_a_six_megabyte_text_is_bounded_above_the_default_context(smol):
    text = "word " * 1_200_000  # 6 MB, as in the issue
    started = time.perf_counter()
    least = smol.min_tokens(text)
    assert time.perf_counter() - started < 0.5
    assert least > 8192, least


def test_encoding_a_long_text_lets_other_threads_run(smol):
    """While one thread tokenizes a big text, another keeps its 10 ms ticks (the GIL is free)."""
    text = "hello world, " * 200_000
    gaps: list[float] = []
    done = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=ticker)
    t.start()
    started = time.perf_counter()
    smol.encode(text)
    took = time.perf_counter() - started
    done.set()
    t.join()
    assert took > 0.2, "the text should take a while to encode for this test to mean anything"
    # plain `encode` holds the GIL for all of `took`; what is left is building the id list
    assert max(gaps) < min(0.5, took / 4), (max(gaps), took)
