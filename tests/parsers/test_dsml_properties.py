"""Spec §2.1 properties P1–P5 on random DeepSeek outputs (real V3.2 and V4 tokenizers).

Each test runs 2,000 examples and checks several properties on each (generation is the cost),
so every property sees ≥ 2,000 examples; model and request mode are drawn per example.
"""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.parsers import Aggregate, Diag, ParserOptions, aggregate

from tests.parsers import fuzz
from tests.parsers.harness import char_tokenization, normalized, run, run_tracking
from tests.parsers.realtok import load_model

MODELS = st.sampled_from(["deepseek-v3.2", "deepseek-v4"])
OUTPUTS = fuzz.outputs(fuzz.DSML_MARKUP, fuzz.CONTROL, fuzz.EOS)


def assert_no_leak(agg: Aggregate) -> None:
    """P1: no DSML id, no tag text, no think or control token in content or reasoning."""
    overflow = any(d.code is Diag.TAG_OVERFLOW for d in agg.diagnostics)  # header bytes returned as text
    for channel in (agg.content, agg.reasoning):
        assert fuzz.D not in channel
        if not overflow:
            for word in fuzz.DSML_WORDS:
                assert word not in channel, (word, channel)
    for call in agg.tool_calls:
        assert fuzz.D not in call.arguments and fuzz.D not in call.name


@fuzz.EXAMPLES
@given(model_name=MODELS, text=OUTPUTS, options=fuzz.parser_options(), fractions=fuzz.cut_points())
def test_no_leak_chunk_invariance_streaming_equals_non_streaming_bounded_holdback(
        model_name: str, text: str, options: ParserOptions, fractions: list[float]) -> None:
    model = load_model(model_name)
    ids = model.encode(text)
    whole = run(model, ids, options)                                     # non-streaming
    chunked = run(model, ids, options, fuzz.cuts_for(len(ids), fractions))
    per_id, pending = run_tracking(model, ids, options)                  # one id per feed
    assert_no_leak(aggregate(whole))                                     # P1
    assert chunked == whole and per_id == whole                          # P2
    assert aggregate(chunked) == aggregate(whole)                        # P4
    assert all(t <= 4 and v <= 2 and u <= 3 for t, v, u in pending)     # P5


@fuzz.EXAMPLES
@given(model_name=MODELS, text=OUTPUTS, options=fuzz.parser_options())
def test_no_leak_and_same_result_under_per_character_tokenization(
        model_name: str, text: str, options: ParserOptions) -> None:
    model = load_model(model_name)
    canonical = run(model, model.encode(text), options)
    per_char = run(model, char_tokenization(model, text), options)
    assert_no_leak(aggregate(per_char))                                  # P1
    assert normalized(per_char) == normalized(canonical)                 # P3
