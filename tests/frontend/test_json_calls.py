"""The JSON-call reader (pdserve/frontend/json_calls.py): a grammar-constrained call document
read as it arrives, against the document itself (json.loads) for every chunking and every
cut, and through the default model's real tokenizer one token id at a time; and the decoder
that tells a call document from an answer in a response_format by its opening."""
from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.frontend.json_calls import CallOrAnswerDecoder, JsonCallDecoder, JsonCallReader, call_openers
from pdserve.frontend.output import TextDecoder
from pdserve.parsers import ContentDelta, InvalidCall, ToolCallArgs, ToolCallEnd, ToolCallStart
from pdserve.parsers.aggregate import aggregate
from pdserve.tokenizer import Tokenizer


def compact(value: Any) -> str:
    """What the grammar lets the model write: compact JSON, keys in the schema's order."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def document(calls: list[tuple[str, Any]], as_list: bool) -> str:
    objs = [{"name": name, "arguments": args} for name, args in calls]
    return compact(objs if as_list else objs[0])


def read(chunks: list[str], reason: str) -> tuple[list, bool]:
    reader = JsonCallReader()
    events: list = []
    for chunk in chunks:
        events += reader.feed(chunk)
    return events + reader.end(reason), reader.done


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


VECTORS = [
    ('{"name":"get_weather","arguments":{"city":"Paris"}}', [("get_weather", '{"city":"Paris"}')]),
    ('{"name":"f","arguments":{}}', [("f", "{}")]),
    # brackets and quotes inside strings are text, not structure
    ('{"name":"f","arguments":{"q":"}]\\"{[","n":[1,{"a":[]}]}}', [("f", '{"q":"}]\\"{[","n":[1,{"a":[]}]}')]),
    ('{"name":"a\\"b\\\\","arguments":{"x":null}}', [('a"b\\', '{"x":null}')]),
    ('[{"name":"a","arguments":{"x":1}},{"name":"b","arguments":{"s":"é"}}]',
     [("a", '{"x":1}'), ("b", '{"s":"é"}')]),
]


@pytest.mark.parametrize("doc, calls", VECTORS)
def test_a_whole_document_gives_its_calls_complete_with_the_arguments_as_written(doc, calls):
    for chunks in ([doc], list(doc)):
        events, done = read(chunks, "stop")
        agg = aggregate(events)
        assert done
        assert [(c.index, c.name, c.arguments, c.complete) for c in agg.tool_calls] == \
            [(i, name, args, True) for i, (name, args) in enumerate(calls)]
        assert not agg.content and not agg.invalid_calls
        assert len({c.id for c in agg.tool_calls}) == len(calls)


def test_a_call_starts_when_its_name_closes_and_its_arguments_stream():
    reader = JsonCallReader()
    assert reader.feed('{"name":"get_wea') == []
    start, = reader.feed('ther","argu')
    assert isinstance(start, ToolCallStart) and (start.index, start.name) == (0, "get_weather")
    assert reader.feed('ments":{"ci') == [ToolCallArgs(0, '{"ci')]
    assert reader.feed('ty":"P"}') == [ToolCallArgs(0, 'ty":"P"}')]
    assert reader.feed("}") == [ToolCallEnd(0, True)] and reader.done


def test_a_cut_inside_the_name_is_reported_and_nothing_reaches_content():
    events, done = read(['{"name":"get_wea'], "length")
    assert not done
    assert events == [InvalidCall(None, "get_wea", '{"name":"get_wea', "truncated_call_dropped")]


def test_an_end_other_than_the_limit_inside_a_call_reports_the_call():
    events, _ = read(['{"name":"f","arguments":{"x":'], "stop")
    agg = aggregate(events)
    assert agg.tool_calls == []
    assert [(c.index, c.name, c.text, c.reason) for c in agg.invalid_calls] == \
        [(0, "f", '{"x":', "ended_inside_block")]


def test_text_the_grammar_forbids_is_reported_not_shown():
    events, done = read(['{"name":"f","arguments":{}}', " and more"], "stop")
    agg = aggregate(events)
    assert not done and not agg.content
    # the document had closed: the call stands, the stray text is the report
    assert [(c.name, c.complete) for c in agg.tool_calls] == [("f", True)]
    assert [(c.index, c.text, c.reason) for c in agg.invalid_calls] == [(None, " and more", "invalid_call")]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10)
CALLS = st.lists(st.tuples(st.text(min_size=1, max_size=10), st.dictionaries(st.text(max_size=6), JSON_VALUES,
                                                                             max_size=4)), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(calls=CALLS, as_list=st.booleans(), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_every_chunking_gives_the_same_calls(calls, as_list, cuts):
    calls = calls if as_list else calls[:1]
    doc = document(calls, as_list)
    events, done = read(split(doc, cuts), "stop")
    agg = aggregate(events)
    assert done
    assert [(c.name, json.loads(c.arguments), c.complete) for c in agg.tool_calls] == \
        [(name, args, True) for name, args in calls]
    assert [c.arguments for c in agg.tool_calls] == [compact(args) for _, args in calls]


@settings(max_examples=300, deadline=None)
@given(calls=CALLS, as_list=st.booleans(), data=st.data())
def test_a_cut_anywhere_returns_the_started_calls_as_far_as_they_got(calls, as_list, data):
    calls = calls if as_list else calls[:1]
    doc = document(calls, as_list)
    cut = data.draw(st.integers(0, len(doc) - 1))
    prefix = doc[:cut]
    events, done = read(split(prefix, data.draw(st.lists(st.integers(0, cut), max_size=6))), "length")
    agg = aggregate(events)
    assert not done and not any(isinstance(e, ContentDelta) for e in events)
    # a call has started once its name's literal closed: `"name":"<name>"` is complete in the prefix
    started = [i for i in range(len(calls)) if _name_end(doc, calls, i) <= cut]
    assert [c.index for c in agg.tool_calls] == started
    for c in agg.tool_calls:
        name, args = calls[c.index]
        assert c.name == name and compact(args).startswith(c.arguments)
        assert c.complete == _call_closed(doc, calls, c.index, cut)
    # a call whose `{` came but whose name did not close is reported, with what it wrote
    offsets = _call_offsets(doc, calls)
    cut_in_name = [i for i in range(len(calls)) if offsets[i] < cut < _name_end(doc, calls, i)]
    assert [(c.index, c.text, c.reason) for c in agg.invalid_calls] == \
        [(None, prefix[offsets[i]:], "truncated_call_dropped") for i in cut_in_name]


def _call_offsets(doc: str, calls: list[tuple[str, Any]]) -> list[int]:
    """Where each call object starts in the document."""
    offsets, at = [], 1 if doc.startswith("[") else 0
    for name, args in calls:
        offsets.append(at)
        at += len(compact({"name": name, "arguments": args})) + 1
    return offsets


def _name_end(doc: str, calls: list[tuple[str, Any]], i: int) -> int:
    return _call_offsets(doc, calls)[i] + len('{"name":' + compact(calls[i][0]))


def _call_closed(doc: str, calls: list[tuple[str, Any]], i: int, cut: int) -> bool:
    name, args = calls[i]
    return _call_offsets(doc, calls)[i] + len(compact({"name": name, "arguments": args})) <= cut


def test_the_decoder_reads_real_token_ids_one_at_a_time(default_model_dir):
    tokenizer = Tokenizer(default_model_dir)
    doc = '[{"name":"get_weather","arguments":{"city":"São Paulo","days":[1,2]}},{"name":"t","arguments":{}}]'
    decoder = JsonCallDecoder(tokenizer)
    parts: list = []
    for token_id in tokenizer.encode(doc):
        parts += decoder.push(token_id).parts
    parts += decoder.finish("stop").parts
    agg = aggregate(parts)
    assert decoder.finish_reason == "tool_calls" and not agg.content
    assert [(c.name, c.arguments) for c in agg.tool_calls] == \
        [("get_weather", '{"city":"São Paulo","days":[1,2]}'), ("t", "{}")]
    # the arguments streamed: more than one fragment for the first call
    assert sum(isinstance(p, ToolCallArgs) and p.index == 0 for p in parts) > 1


def test_the_decoder_cut_by_the_limit_answers_length_with_the_call_so_far(default_model_dir):
    tokenizer = Tokenizer(default_model_dir)
    ids = tokenizer.encode('{"name":"get_weather","arguments":{"city":"Paris"}}')
    decoder = JsonCallDecoder(tokenizer)
    parts: list = []
    for token_id in ids[:-3]:
        parts += decoder.push(token_id).parts
    parts += decoder.finish("length").parts
    agg = aggregate(parts)
    assert decoder.finish_reason == "length" and not agg.content and not agg.invalid_calls
    call, = agg.tool_calls
    assert call.name == "get_weather" and not call.complete
    assert '{"city":"Paris"}'.startswith(call.arguments) and call.arguments != '{"city":"Paris"}'


# ---- a call document or an answer in a response_format ------------------------------------------

NAMES = ["get_weather", "get_time"]
# What the default model's tokenizer gives back as it was: its vocabulary has no byte tokens for
# the UTF-8 lead bytes of planes 4 and up (U+40000…), which it encodes as an unknown token.
TEXT = st.text(st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs",)), max_size=6)
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | TEXT,
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                      max_leaves=10)


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


def call_or_answer(tokenizer: Tokenizer, text: str, parallel: bool, reason: str = "stop") -> tuple[Any, str]:
    """The text's token ids through a CallOrAnswerDecoder, one at a time."""
    answer = TextDecoder(tokenizer, [], ends=tokenizer.stop_token_ids)
    decoder = CallOrAnswerDecoder(tokenizer, call_openers(NAMES, parallel), answer)
    parts: list = []
    for token_id in tokenizer.encode(text):
        parts += decoder.push(token_id).parts
    parts += decoder.finish(reason).parts
    assert decoder.finish_reason is not None
    return aggregate(parts), decoder.finish_reason


# Answers that open as a call document would, up to where they cannot be one.
LOOKALIKES = ['{"name":"get_weather"}', '{"name":"get_weather","args":{}}', '{"name":"get_weatherly","arguments":1}',
              '[{"name":"get_time"}]', '{"name":"Alice","age":30}', "{", '{"na', "[", ""]


@pytest.mark.parametrize("parallel", [True, False])
def test_an_answer_that_opens_like_a_call_is_content_as_written(default_tokenizer, parallel):
    for text in LOOKALIKES:
        agg, reason = call_or_answer(default_tokenizer, text, parallel)
        assert (agg.content, agg.tool_calls, agg.invalid_calls, reason) == (text, [], [], "stop"), text


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(NAMES), st.dictionaries(TEXT, VALUES, max_size=3)),
                      min_size=1, max_size=3),
       answer=st.dictionaries(TEXT, VALUES, max_size=4), parallel=st.booleans(),
       data=st.data())
def test_calls_are_calls_and_answers_are_content_whole_or_cut(default_tokenizer, calls, answer, parallel, data):
    calls = calls if parallel else calls[:1]
    doc = document(calls, parallel)
    agg, reason = call_or_answer(default_tokenizer, doc, parallel)
    assert (reason, agg.content) == ("tool_calls", "")
    assert [(c.name, c.arguments, c.complete) for c in agg.tool_calls] == \
        [(name, compact(args), True) for name, args in calls]
    text = compact(answer)
    agg, reason = call_or_answer(default_tokenizer, text, parallel)
    assert (reason, agg.content, agg.tool_calls) == ("stop", text, [])
    # cut by the limit: a call document gives its started calls, anything else its text so far
    ids = default_tokenizer.encode(doc)
    cut = default_tokenizer.decode(ids[:data.draw(st.integers(0, len(ids) - 1))])
    agg, reason = call_or_answer(default_tokenizer, cut, parallel, "length")
    opened = any(cut.startswith(o) for o in call_openers(NAMES, parallel))
    assert reason == "length" and agg.content == ("" if opened else cut)
