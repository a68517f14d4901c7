"""The 28 test vectors of the DSML parser spec (docs/dsml.md describes the format), written out as model output text.

`｜DSML｜`, `</think>` and the EOS string are tokenized into their single ids by the real
tokenizers, exactly as the model would emit them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from pdserve.parsers import Diag, Emission, FinishReason, ParserOptions, ToolsMode

D = "\uff5cDSML\uff5c"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
THINK_END = "</think>"


def param(key: str, value: str, string: bool = True) -> str:
    flag = "true" if string else "false"
    return f'<{D}parameter name="{key}" string="{flag}">{value}</{D}parameter>'


def invoke(name: str, *params: str) -> str:
    return f'<{D}invoke name="{name}">\n' + "\n".join(params) + f"\n</{D}invoke>"


def block(*invokes: str, name: str = "function_calls") -> str:
    return f"<{D}{name}>\n" + "\n".join(invokes) + f"\n</{D}{name}>"


def args(**kwargs: object) -> str:
    """The reference decoder's arguments string for already-typed values."""
    return json.dumps(kwargs, ensure_ascii=False)


@dataclass(frozen=True)
class Vector:
    name: str
    text: str
    reasoning: str = ""
    content: str = ""
    calls: tuple[tuple[str, str, bool], ...] = ()  # (name, arguments, complete)
    finish: FinishReason = FinishReason.STOP
    diags: tuple[Diag, ...] = ()
    failed: bool = False
    options: ParserOptions = field(default_factory=ParserOptions)
    model: str = "v32"
    length: bool = False  # the engine hit max_tokens
    fused: tuple[int, ...] = ()  # canonical tokenization must contain these ids (spec's notes)


START = ParserOptions(start_in_reasoning=True)
STRICT = ParserOptions(strict=True)
WEATHER_BJ = invoke("get_weather", param("city", "Beijing"), param("days", "3", False))
EMPTY_F = f'<{D}invoke name="f">\n\n</{D}invoke>'
CMD = 'echo "hi" > C:\\tmp\\out.txt\n\tdone'
TRUNCATED = (f'Checking.\n\n<{D}function_calls>\n<{D}invoke name="get_weather">\n'
             f'<{D}parameter name="city" string="true">Par')
V23_TEXT = ("Plan." + THINK_END + "Calling two tools.\n\n"
            + block(invoke("a", param("q", "x y"), param("n", "[1, 2]", False)),
                    f'<{D}invoke name="b">\n\n</{D}invoke>')
            + EOS)

VECTORS: tuple[Vector, ...] = (
    Vector("V01", "Let me check.\n\n" + block(WEATHER_BJ) + EOS, content="Let me check.",
           calls=(("get_weather", '{"city": "Beijing", "days": 3}', True),), finish=FinishReason.TOOL_CALLS),
    Vector("V02", "User wants Tokyo weather; call the tool." + THINK_END + "\n\n"
           + block(invoke("get_weather", param("city", "東京"))) + EOS,
           reasoning="User wants Tokyo weather; call the tool.",
           calls=(("get_weather", args(city="東京"), True),), finish=FinishReason.TOOL_CALLS, options=START),
    Vector("V03", "\n\n" + block(invoke("get_weather", param("location", "杭州"), param("date", "2024-01-16")),
                                 invoke("get_weather", param("location", "北京"), param("date", "2024-01-16"))) + EOS,
           calls=(("get_weather", args(location="杭州", date="2024-01-16"), True),
                  ("get_weather", args(location="北京", date="2024-01-16"), True)), finish=FinishReason.TOOL_CALLS),
    Vector("V04", "\n\n" + block(invoke("run", param("cmd", CMD))) + EOS,
           calls=(("run", args(cmd=CMD), True),), finish=FinishReason.TOOL_CALLS),
    Vector("V05", "\n\n" + block(invoke("search", param("filters", '{"tags": ["a", "b"], "min": 1.5}', False),
                                        param("limit", "10", False), param("exact", "true", False),
                                        param("cursor", "null", False))) + EOS,
           calls=(("search", '{"filters": {"tags": ["a", "b"], "min": 1.5}, "limit": 10, "exact": true, '
                             '"cursor": null}', True),), finish=FinishReason.TOOL_CALLS),
    Vector("V06", "Voilà 😀.\n\n" + block(invoke("note", param("text", "naïve café 😀 — 北京 ✓"))) + EOS,
           content="Voilà 😀.", calls=(("note", args(text="naïve café 😀 — 北京 ✓"), True),),
           finish=FinishReason.TOOL_CALLS),
    Vector("V07", "Compare a<b and </div> here.\n\n" + block(invoke("lint", param("code", 'if a<b: print("</div>")')))
           + EOS, content="Compare a<b and </div> here.",
           calls=(("lint", args(code='if a<b: print("</div>")'), True),), finish=FinishReason.TOOL_CALLS),
    Vector("V08", TRUNCATED, content="Checking.", calls=(("get_weather", '{"city": "Par', False),),
           finish=FinishReason.LENGTH, diags=(Diag.ENDED_INSIDE_BLOCK,), length=True),
    Vector("V08b", TRUNCATED, content="Checking.", finish=FinishReason.LENGTH,
           diags=(Diag.ENDED_INSIDE_BLOCK, Diag.TRUNCATED_CALL_DROPPED), length=True,
           options=ParserOptions(emission=Emission.ATOMIC)),
    Vector("V09", "Sure.\n\n" + block(invoke("get_weather", param("city", "Paris"))) + EOS, content="Sure.",
           diags=(Diag.SUPPRESSED,), options=ParserOptions(tools_mode=ToolsMode.SUPPRESS)),
    Vector("V10", "\n\n" + block(invoke("f", param("n", "three", False))) + EOS,
           calls=(("f", '{"n": "three"}', True),), finish=FinishReason.TOOL_CALLS, diags=(Diag.VALUE_NOT_JSON,)),
    Vector("V10s", "\n\n" + block(invoke("f", param("n", "three", False))) + EOS, finish=FinishReason.ERROR,
           diags=(Diag.VALUE_NOT_JSON,), failed=True, options=STRICT),
    Vector("V11", f'\n\n<{D}function_calls>\n<{D}invoke name="f">\n' + param("a", "x") + f"\n</{D}function_calls>"
           + EOS,
           calls=(("f", '{"a": "x"}', True),), finish=FinishReason.TOOL_CALLS, diags=(Diag.CLOSED_IMPLICITLY,)),
    Vector("V12", f'\n\n<{D}function_calls>\n<{D}invok name="f">\n' + param("x", "1", False)
           + f"\n</{D}invoke>\n</{D}function_calls>" + EOS,
           diags=(Diag.UNKNOWN_TAG, Diag.STRAY_MARKER, Diag.TEXT_BETWEEN_TAGS, Diag.STRAY_MARKER, Diag.STRAY_MARKER)),
    Vector("V13", f"Hello </{D}function_calls> wor{D}ld" + EOS, content="Hello  world",
           diags=(Diag.STRAY_MARKER, Diag.BARE_DSML)),
    Vector("V14", "Need the weather.\n\n" + block(invoke("get_weather", param("city", "Oslo"))) + EOS,
           reasoning="Need the weather.", calls=(("get_weather", args(city="Oslo"), True),),
           finish=FinishReason.TOOL_CALLS, diags=(Diag.REASONING_CLOSED_IMPLICITLY,), options=START),
    Vector("V15", "The answer is 42." + THINK_END + EOS, content="The answer is 42.", diags=(Diag.STRAY_THINK,)),
    Vector("V16", "\n\n" + block(invoke("write", param("s", "use <think>x</think> tags"))) + EOS,
           calls=(("write", args(s="use <think>x</think> tags"), True),), finish=FinishReason.TOOL_CALLS),
    Vector("V17", "\n\n" + block(f'<{D}invoke name="get_time">\n\n</{D}invoke>') + EOS,
           calls=(("get_time", "{}", True),), finish=FinishReason.TOOL_CALLS),
    Vector("V18", "\n\n" + block(invoke("f", param("a", "1"), param("a", "2"))) + EOS,
           calls=(("f", '{"a": "1"}', True),), finish=FinishReason.TOOL_CALLS, diags=(Diag.DUPLICATE_PARAMETER,)),
    Vector("V19", "\n\n" + block(invoke("a", param("x", "1", False)), invoke("b", param("x", "2", False))) + EOS,
           calls=(("a", '{"x": 1}', True),), finish=FinishReason.TOOL_CALLS, diags=(Diag.MAX_CALLS,),
           options=ParserOptions(parallel_tool_calls=False)),
    Vector("V20", "\n\n" + block(f'<{D}invoke name="get_weather">\n{{"city": "Lima", "days": 2}}\n</{D}invoke>') + EOS,
           calls=(("get_weather", '{"city": "Lima", "days": 2}', True),), finish=FinishReason.TOOL_CALLS),
    Vector("V21", "Calling.\n\n" + block(EMPTY_F) + "\n\nDone." + EOS, content="Calling.\n\nDone.",
           calls=(("f", "{}", True),), finish=FinishReason.TOOL_CALLS),
    Vector("V22", "Hi " + block(EMPTY_F) + EOS, content="Hi ", calls=(("f", "{}", True),),
           finish=FinishReason.TOOL_CALLS, diags=(Diag.NO_SEPARATOR,), fused=(818,)),
    Vector("V22s", "Hi " + block(EMPTY_F) + EOS, content="Hi ", calls=(("f", "{}", True),),
           finish=FinishReason.TOOL_CALLS, diags=(Diag.NO_SEPARATOR,), options=STRICT, fused=(818,)),
    Vector("V23", V23_TEXT, reasoning="Plan.", content="Calling two tools.",
           calls=(("a", '{"q": "x y", "n": [1, 2]}', True), ("b", "{}", True)), finish=FinishReason.TOOL_CALLS,
           options=ParserOptions(strict=True, start_in_reasoning=True)),
    Vector("V24", "\n\n" + block(invoke("get_weather", param("city", "Tokyo"), param("days", "3", False)),
                                 name="tool_calls") + EOS,
           calls=(("get_weather", '{"city": "Tokyo", "days": 3}', True),), finish=FinishReason.TOOL_CALLS,
           options=STRICT, model="v4"),
    Vector("V25", "\n\n" + block(invoke("f", param("s", ""))) + EOS, calls=(("f", '{"s": ""}', True),),
           finish=FinishReason.TOOL_CALLS, fused=(11387,)),
)
