"""Hypothesis strategies: model outputs built from prose, markup fragments and marker strings.

Prose fragments never spell a markup word, so any markup word found in content or reasoning
came from a tag and is a leak.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from pdserve.parsers import Emission, ParserOptions, ToolsMode

# ≥ 2,000 examples per property in CI; raise PDSERVE_FUZZ_EXAMPLES for a deeper local run.
EXAMPLES = settings(max_examples=int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "2000")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

D = "\uff5cDSML\uff5c"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"

PROSE = ["Hello", " world", "a<b", " x > y", "。", "北京", "東京", "😀", "é", "naïve", "1.5", "{", "}", '"',
         "'", "=", " ", "\t", "\n", "\n\n", "<", "</", ">", "/>", "div", "<div>", "</div>", ".", ",", "？",
         "🇫🇷", "ok", "\u200b", "\\", "\\n"]
CONTROL = ["<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>", "<\uff5cbegin\u2581of\u2581sentence\uff5c>"]
DSML_MARKUP = [f"<{D}function_calls>", f"</{D}function_calls>", f"<{D}tool_calls>", f"</{D}tool_calls>",
               f'<{D}invoke name="get_weather">', f'<{D}invoke name="f">', f"</{D}invoke>",
               f'<{D}parameter name="city" string="true">', f'<{D}parameter name="n" string="false">',
               f'<{D}parameter name="q">', f"</{D}parameter>", D, f"<{D}", f"</{D}", f"<{D} ", '">', '"></',
               "<think>", "</think>", '{"a": 1}', "[1, 2]", "true", "\n\n<", "\n</"]
# Words that only markup contains; seeing one in content or reasoning is a leak. (For GLM and
# Hermes the markers are ids, so their text can only appear if a marker id leaked.)
DSML_WORDS = (D, "invoke", "parameter", "function_calls", "tool_calls", "string=", "<think>", "</think>",
              *CONTROL, EOS)

GLM_MARKUP = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
              "get_weather", "city", "days", "3", "<think>", "</think>", '{"a": 1}', "<|observation|>"]
GLM_WORDS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
             "<think>", "</think>", "<|user|>", "<|observation|>", "<|assistant|>", "<|system|>", "[gMASK]")
GLM_CONTROL = ["<|assistant|>", "<|system|>", "[gMASK]"]

HERMES_MARKUP = ["<tool_call>", "</tool_call>", '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                 '{"name": "f", "arguments": {}}', '{"name": ', '"arguments"', "<think>", "</think>",
                 "<|im_end|>"]
HERMES_WORDS = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_start|>", "<|im_end|>",
                "<|vision_start|>")
HERMES_CONTROL = ["<|im_start|>", "<|vision_start|>"]


def outputs(markup: list[str], control: list[str], eos: str, max_size: int = 30) -> st.SearchStrategy[str]:
    """Model outputs: prose and markup fragments, control tokens, now and then an end marker.
    (One flat sampled_from keeps generation cheap enough for thousands of examples.)"""
    return st.lists(st.sampled_from([*PROSE, *markup, *control, eos]), max_size=max_size).map("".join)


def options_from_bits(bits: int) -> ParserOptions:
    """Every request mode from 8 bits: tools mode, parallel, strict, emission, reasoning."""
    emission = [None, Emission.INCREMENTAL, Emission.ATOMIC, None][(bits >> 3) & 3]
    return ParserOptions(tools_mode=ToolsMode.SUPPRESS if bits & 1 else ToolsMode.EMIT,
                         parallel_tool_calls=not bits & 2, strict=bool(bits & 4), emission=emission,
                         separate_reasoning=not bits & 32, start_in_reasoning=bool(bits & 64),
                         call_id_prefix="call_fuzz")


def parser_options() -> st.SearchStrategy[ParserOptions]:
    return st.integers(0, 127).map(options_from_bits)


def cut_points() -> st.SearchStrategy[list[float]]:
    return st.lists(st.floats(0, 1), max_size=8)


def cuts_for(n: int, fractions: list[float]) -> tuple[int, ...]:
    return tuple(sorted({int(f * n) for f in fractions} - {0, n}))
