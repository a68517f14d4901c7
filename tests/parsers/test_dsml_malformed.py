"""Spec §2.8, the malformed-markup table: one test per row, lenient and strict side by side."""
from __future__ import annotations

import pytest

from pdserve.parsers import Aggregate, Diag, FinishReason, ParserOptions, aggregate

from tests.parsers.harness import run
from tests.parsers.realtok import Model
from tests.parsers.vectors import D, EOS, invoke, param

LENIENT = ParserOptions()
STRICT = ParserOptions(strict=True)


def parse(model: Model, text: str, options: ParserOptions = LENIENT) -> Aggregate:
    return aggregate(run(model, model.encode(text), options))


def calls(agg: Aggregate) -> list[tuple[str, str, bool]]:
    return [(c.name, c.arguments, c.complete) for c in agg.tool_calls]


def codes(agg: Aggregate) -> list[Diag]:
    return [d.code for d in agg.diagnostics]


def assert_failed(agg: Aggregate, code: Diag, complete_calls: int = 0) -> None:
    """Strict emits atomically per call: only calls completed before the error were sent."""
    assert agg.failed and agg.finish_reason is FinishReason.ERROR
    assert agg.diagnostics[-1].code is code and agg.diagnostics[-1].fatal
    assert [c.complete for c in agg.tool_calls] == [True] * complete_calls


def test_bare_dsml_is_dropped_or_fails(v32: Model) -> None:
    text = f"Hello wor{D}ld" + EOS
    lenient = parse(v32, text)
    assert lenient.content == "Hello world" and codes(lenient) == [Diag.BARE_DSML]
    assert_failed(parse(v32, text, STRICT), Diag.BARE_DSML)


@pytest.mark.parametrize("where", ["content", "block"])
def test_unknown_or_misspelled_tag_is_dropped_whole_or_fails(v32: Model, where: str) -> None:
    if where == "content":
        text = f"a <{D}foo bar=\"1\"> b" + EOS
        expected_content = "a  b"
    else:
        text = f"\n\n<{D}function_calls>\n<{D}invok name=\"f\">\n</{D}function_calls>" + EOS
        expected_content = ""
    lenient = parse(v32, text)
    assert lenient.content == expected_content and lenient.tool_calls == []
    assert codes(lenient) == [Diag.UNKNOWN_TAG]
    assert_failed(parse(v32, text, STRICT), Diag.UNKNOWN_TAG)


def test_header_over_512_bytes_goes_back_to_the_region_as_text(v32: Model) -> None:
    long = "a" * 600
    text = f"x <{D}{long} end" + EOS
    lenient = parse(v32, text)
    assert lenient.content == f"x {long} end"  # `<` and the DSML id dropped, the bytes returned
    assert codes(lenient) == [Diag.TAG_OVERFLOW]
    assert_failed(parse(v32, text, STRICT), Diag.TAG_OVERFLOW)


def test_string_false_value_that_is_not_json_becomes_a_string_or_fails(v32: Model) -> None:
    text = "\n\n" + f"<{D}function_calls>\n" + invoke("f", param("n", "three", False)) + f"\n</{D}function_calls>" + EOS
    lenient = parse(v32, text)
    assert calls(lenient) == [("f", '{"n": "three"}', True)] and codes(lenient) == [Diag.VALUE_NOT_JSON]
    assert_failed(parse(v32, text, STRICT), Diag.VALUE_NOT_JSON)


def test_missing_parameter_closer_is_closed_implicitly_or_fails(v32: Model) -> None:
    text = (f'\n\n<{D}function_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">x\n'
            + param("b", "2", False) + f"\n</{D}invoke>\n</{D}function_calls>" + EOS)
    lenient = parse(v32, text)
    assert calls(lenient) == [("f", '{"a": "x\\n", "b": 2}', True)]  # the value stays verbatim
    assert codes(lenient) == [Diag.CLOSED_IMPLICITLY]
    assert_failed(parse(v32, text, STRICT), Diag.STRAY_MARKER)


def test_missing_invoke_closer_is_closed_implicitly_or_fails(v32: Model) -> None:
    text = (f'\n\n<{D}function_calls>\n<{D}invoke name="f">\n' + param("a", "1") + "\n"
            + invoke("g") + f"\n</{D}function_calls>" + EOS)
    lenient = parse(v32, text)
    assert calls(lenient) == [("f", '{"a": "1"}', True), ("g", "{}", True)]
    assert codes(lenient) == [Diag.CLOSED_IMPLICITLY]
    assert_failed(parse(v32, text, STRICT), Diag.STRAY_MARKER)


def test_missing_block_closer_keeps_complete_calls(v32: Model) -> None:
    """Before a second block opener the first block continues (the opener is dropped); at the
    end of the stream the complete calls stand and the unclosed block is reported."""
    text = (f"\n\n<{D}function_calls>\n" + invoke("f") + f"\n<{D}function_calls>\n" + invoke("g")
            + f"\n</{D}function_calls>" + EOS)
    lenient = parse(v32, text)
    assert calls(lenient) == [("f", "{}", True), ("g", "{}", True)]
    assert codes(lenient) == [Diag.STRAY_MARKER]
    assert_failed(parse(v32, text, STRICT), Diag.STRAY_MARKER, complete_calls=1)
    at_end = parse(v32, f"\n\n<{D}function_calls>\n" + invoke("f") + EOS)
    assert calls(at_end) == [("f", "{}", True)] and codes(at_end) == [Diag.ENDED_INSIDE_BLOCK]
    assert at_end.finish_reason is FinishReason.TOOL_CALLS


def test_block_opened_inside_reasoning_closes_reasoning_or_fails(v32: Model) -> None:
    text = "Thinking.\n\n" + f"<{D}function_calls>\n" + invoke("f") + f"\n</{D}function_calls>" + EOS
    lenient = parse(v32, text, ParserOptions(start_in_reasoning=True))
    assert lenient.reasoning == "Thinking." and lenient.content == ""
    assert calls(lenient) == [("f", "{}", True)] and codes(lenient) == [Diag.REASONING_CLOSED_IMPLICITLY]
    strict = parse(v32, text, ParserOptions(strict=True, start_in_reasoning=True))
    assert_failed(strict, Diag.STRAY_MARKER)
    assert strict.reasoning == "Thinking."


def test_text_between_tags_is_dropped_or_fails(v32: Model) -> None:
    text = f"\n\n<{D}function_calls>\nhello there\n" + invoke("f") + f"\n</{D}function_calls>" + EOS
    lenient = parse(v32, text)
    assert lenient.content == "" and calls(lenient) == [("f", "{}", True)]
    assert codes(lenient) == [Diag.TEXT_BETWEEN_TAGS]
    assert_failed(parse(v32, text, STRICT), Diag.TEXT_BETWEEN_TAGS)


def test_text_after_the_block_is_content_or_fails(v32: Model) -> None:
    text = "Calling.\n\n" + f"<{D}function_calls>\n" + invoke("f") + f"\n</{D}function_calls>\n\nDone." + EOS
    lenient = parse(v32, text)
    assert lenient.content == "Calling.\n\nDone." and calls(lenient) == [("f", "{}", True)]  # one separator kept
    strict = parse(v32, text, STRICT)
    assert strict.failed and strict.diagnostics[-1].code is Diag.TEXT_AFTER_BLOCK


def test_opener_without_separator_is_accepted_with_a_diagnostic_in_both_modes(v32: Model) -> None:
    """Strict mode accepts the block opener without the blank line the encoder renders (the
    peers' outputs lack it); the deviation is a non-fatal diagnostic (docs/tool-calls.md §6)."""
    text = "Hi " + f"<{D}function_calls>\n" + invoke("f") + f"\n</{D}function_calls>" + EOS
    for options in (LENIENT, STRICT):
        agg = parse(v32, text, options)
        assert agg.content == "Hi " and calls(agg) == [("f", "{}", True)] and not agg.failed
        assert codes(agg) == [Diag.NO_SEPARATOR]


@pytest.mark.parametrize("options", [LENIENT, STRICT], ids=["lenient", "strict"])
def test_stray_think_markers_in_content_are_dropped_in_both_modes(v32: Model, options: ParserOptions) -> None:
    agg = parse(v32, "a</think>b<think>c" + EOS, options)
    assert agg.content == "abc" and agg.reasoning == "" and not agg.failed
    assert codes(agg) == [Diag.STRAY_THINK, Diag.STRAY_THINK]


def test_control_tokens_never_become_text(v32: Model) -> None:
    """BOS, role markers, FIM and placeholder ids are not text, even where not marked special."""
    controls = ["<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>",
                "<|EOT|>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5ctool\u2581calls\u2581begin\uff5c>"]
    ids = v32.encode("a") + [v32.id(c) for c in controls] + v32.encode("b")
    agg = aggregate(run(v32, ids, LENIENT))
    assert agg.content == "ab" and agg.diagnostics == []


def test_ids_after_eos_are_ignored(v32: Model) -> None:
    agg = aggregate(run(v32, v32.encode("done" + EOS + "more text"), LENIENT))
    assert agg.content == "done" and agg.finish_reason is FinishReason.STOP
