"""What the caller is told about tool calls: ids, indices, incremental vs atomic, suppression."""
from __future__ import annotations

from pdserve.parsers import (ContentDelta, Diag, Emission, ParserOptions, ReasoningDelta, ToolCallArgs, ToolCallEnd,
                             ToolCallStart, ToolsMode, aggregate, coalesce)

from tests.parsers.harness import run
from tests.parsers.realtok import Model
from tests.parsers.vectors import EOS, VECTORS, block, invoke, param

V01 = next(v for v in VECTORS if v.name == "V01")
TWO = "\n\n" + block(invoke("unknown", param("x", "1")), invoke("get_weather", param("city", "Oslo"))) + EOS


def tool_events(events: list) -> list:
    return [e for e in events if isinstance(e, (ToolCallStart, ToolCallArgs, ToolCallEnd))]


def test_v01_streams_in_the_spec_illustrated_shape(v32: Model) -> None:
    events = run(v32, v32.encode(V01.text), ParserOptions(call_id_prefix="call_R"))
    assert tool_events(events) == [
        ToolCallStart(0, "call_R_0", "get_weather"), ToolCallArgs(0, '{"city": "'), ToolCallArgs(0, "Beijing"),
        ToolCallArgs(0, '"'), ToolCallArgs(0, ', "days": 3'), ToolCallArgs(0, "}"), ToolCallEnd(0, True)]


def test_atomic_emission_releases_each_call_whole_at_its_end(v32: Model) -> None:
    events = run(v32, v32.encode(V01.text), ParserOptions(emission=Emission.ATOMIC, call_id_prefix="call_R"))
    assert tool_events(events) == [ToolCallStart(0, "call_R_0", "get_weather"),
                                   ToolCallArgs(0, '{"city": "Beijing", "days": 3}'), ToolCallEnd(0, True)]
    assert aggregate(events) == aggregate(run(v32, v32.encode(V01.text), ParserOptions(call_id_prefix="call_R")))


def test_strict_defaults_to_atomic_emission() -> None:
    assert ParserOptions(strict=True).emission_mode is Emission.ATOMIC
    assert ParserOptions().emission_mode is Emission.INCREMENTAL


def test_dropped_unknown_tools_do_not_take_an_index(v32: Model) -> None:
    options = ParserOptions(known_tools=frozenset({"get_weather"}), drop_unknown_tools=True, call_id_prefix="c")
    agg = aggregate(run(v32, v32.encode(TWO), options))
    assert [(c.index, c.id, c.name) for c in agg.tool_calls] == [(0, "c_0", "get_weather")]
    assert [d.code for d in agg.diagnostics] == [Diag.UNKNOWN_TOOL]
    emitted = aggregate(run(v32, v32.encode(TWO), ParserOptions(known_tools=frozenset({"get_weather"}))))
    assert [c.name for c in emitted.tool_calls] == ["unknown", "get_weather"]  # emitted by default


def test_suppressed_calls_leave_finish_reason_stop(v32: Model) -> None:
    agg = aggregate(run(v32, v32.encode(TWO), ParserOptions(tools_mode=ToolsMode.SUPPRESS)))
    assert agg.tool_calls == [] and agg.content == "" and agg.finish_reason.value == "stop"
    assert [d.code for d in agg.diagnostics] == [Diag.SUPPRESSED, Diag.SUPPRESSED]


def test_reasoning_is_reported_as_content_when_not_separated(v32: Model) -> None:
    text = "Plan.</think>Answer." + EOS
    agg = aggregate(run(v32, v32.encode(text), ParserOptions(start_in_reasoning=True, separate_reasoning=False)))
    assert (agg.reasoning, agg.content) == ("", "Plan.Answer.")


def test_coalesce_merges_adjacent_deltas_only() -> None:
    events = [ContentDelta("a"), ContentDelta("b"), ReasoningDelta("r"), ToolCallArgs(0, "{"), ToolCallArgs(0, "}"),
              ToolCallArgs(1, "{"), ContentDelta("c")]
    assert coalesce(events) == [ContentDelta("ab"), ReasoningDelta("r"), ToolCallArgs(0, "{}"), ToolCallArgs(1, "{"),
                                ContentDelta("c")]


def test_a_second_block_continues_the_call_indices(v32: Model) -> None:
    text = ("\n\n" + block(invoke("a")) + "\n\nThen more.\n\n" + block(invoke("b"), invoke("c")) + EOS)
    agg = aggregate(run(v32, v32.encode(text), ParserOptions()))
    assert [(c.index, c.name, c.arguments) for c in agg.tool_calls] == [(0, "a", "{}"), (1, "b", "{}"), (2, "c", "{}")]
    assert agg.content == "Then more." and agg.diagnostics == []


def test_ids_beyond_the_tokenizer_are_ignored(v32: Model) -> None:
    """The checkpoint's embedding has more rows (129280) than the tokenizer has tokens."""
    ids = v32.encode("a") + [129000, 129279] + v32.encode("b")
    assert aggregate(run(v32, ids, ParserOptions())).content == "ab"
