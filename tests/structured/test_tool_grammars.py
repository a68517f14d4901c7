"""Grammars of the models' own tool-call syntax (pdserve/structured/tool_grammars.py), with the
real tokenizers (DeepSeek V3.2 and V4, GLM-4.7, Qwen3, DeepSeek V3.1 and V3) and the real
llguidance backend of each:

* every valid call text (the spec's vectors, written as each model's encoder writes them) is
  accepted token by token and ends where EOS is allowed, and the model's own parser reads
  the ids back to exactly those calls, whose arguments validate against the tools' schemas;
* invalid outputs (plain text, another function, a missing, mistyped or out-of-enum argument,
  text before the calls) are refused at some token;
* a scripted greedy "model" that would say plain text (or call the wrong function) is forced
  by the masks into a valid call in its own syntax: the argmax of the scripted model's logits
  under the mask, as the sampler computes it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
import torch

from pdserve.parsers import Format, ParserOptions, Profile, aggregate, make_parser, resolve_profile, tool_schemas
from pdserve.structured import GrammarKind, Grammars, GrammarSpec
from pdserve.structured.bitmask import new_bitmask, unpack
from pdserve.structured.factory import grammars_for_tokenizer
from pdserve.structured.tool_grammars import ToolGrammarError, call_syntax_grammar
from pdserve.tokenizer import Tokenizer

from tests.frontend.scripted import DSML, write_tokenizer

D = DSML
# family -> (tokenizer, the --tool-call-parser name the router would resolve). DeepSeek V3 (fenced
# JSON) shares V3.1's markers: one tokenizer serves both.
FAMILIES = {"v32": ("deepseek-v3.2", "deepseek_v32"), "v4": ("deepseek-v4", "deepseek_v4"),
            "glm": ("glm-4.7-flash", "glm"), "qwen": ("qwen-3", "hermes"),
            "v31": ("deepseek-v3.1", "deepseek_v31"), "v3": ("deepseek-v3.1", "deepseek_v3")}


def fn(name: str, properties: dict[str, Any], required: list[str], strict: bool = False) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "strict": strict, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


TOOLS = [
    fn("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city"]),
    fn("get_time", {"tz": {"type": "string", "enum": ["Europe/Paris", "Asia/Tokyo"]}}, ["tz"]),
    fn("search", {"filters": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                                               "min": {"type": "number"}}},
                  "limit": {"type": "integer"}, "exact": {"type": "boolean"}}, ["filters"]),
    fn("run", {"cmd": {"type": "string"}}, ["cmd"]),
    fn("get_news", {}, []),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# Valid calls (after the spec's vectors V01, V03–V07, V17, V25 and the time zone enum).
VALID = {
    "V01": [("get_weather", {"city": "Beijing", "days": 3})],
    "V03": [("get_weather", {"city": "杭州", "days": 1}), ("get_weather", {"city": "北京"})],
    "V04": [("run", {"cmd": 'echo "hi" > C:\\tmp\\out.txt\n\tdone'})],
    "V05": [("search", {"filters": {"tags": ["a", "b"], "min": 1.5}, "limit": 10, "exact": True})],
    "V06": [("run", {"cmd": "naïve café 😀 — 北京 ✓"})],
    "V07": [("run", {"cmd": 'if a<b: print("</div>")'})],
    "V17": [("get_news", {})],
    "V25": [("run", {"cmd": ""})],
    "enum": [("get_time", {"tz": "Asia/Tokyo"}), ("get_news", {})],
}
INVALID = {
    "plain text": "Sure, it is sunny in Paris.",
    "unknown function": [("get_forecast", {"city": "Paris"})],
    "missing required": [("get_weather", {"days": 3})],
    "mistyped": [("get_weather", {"city": "Paris", "days": "three"})],
    "out of enum": [("get_time", {"tz": "Mars/Base"})],
    "unknown parameter": [("get_weather", {"city": "Paris", "unit": "celsius"})],
    "text first": ("Let me check.", [("get_weather", {"city": "Paris"})]),
}


@dataclass
class Fam:
    name: str
    profile: Profile
    tokenizer: Tokenizer
    grammars: Grammars

    @property
    def eos(self) -> int:
        return min(self.tokenizer.stop_token_ids)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, tuple[Tokenizer, Grammars]]:
    """One Tokenizer and grammar cache per tokenizer file, shared by the families that use it."""
    return {}


@pytest.fixture(scope="module", params=list(FAMILIES))
def fam(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        tokenizers: dict[str, tuple[Tokenizer, Grammars]]) -> Fam:
    """The family's profile as the router resolves it, on the router's Tokenizer of a model
    directory holding the real tokenizer files."""
    key, parser = FAMILIES[request.param]
    if key not in tokenizers:
        path = tmp_path_factory.mktemp(key)
        write_tokenizer(key, path)
        (path / "config.json").write_text("{}")
        tokenizer = Tokenizer(path)
        tokenizers[key] = tokenizer, grammars_for_tokenizer(tokenizer)
    tokenizer, grammars = tokenizers[key]
    return Fam(request.param, resolve_profile(tokenizer, override=parser), tokenizer, grammars)


# ---- what each model's encoder writes --------------------------------------------------------------

def render(f: Fam, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The calls as the model's chat template writes them (no content before them)."""
    p = f.profile
    dumps = lambda v: json.dumps(v, ensure_ascii=False)  # noqa: E731 - the encoders' json.dumps
    if p.format is Format.DSML:
        def param(k: str, v: Any) -> str:
            s = isinstance(v, str)
            return f'<{D}parameter name="{k}" string="{"true" if s else "false"}">{v if s else dumps(v)}</{D}parameter>'
        invokes = "\n".join(f'<{D}invoke name="{n}">\n' + "\n".join(param(k, v) for k, v in a.items())
                            + f"\n</{D}invoke>" for n, a in calls)
        block = p.dsml.block_name  # type: ignore[union-attr]
        return f"\n\n<{D}{block}>\n{invokes}\n</{D}{block}>"
    if p.format is Format.GLM:
        return "".join(f"<tool_call>{n}" + "".join(
            f"<arg_key>{k}</arg_key><arg_value>{v if isinstance(v, str) else dumps(v)}</arg_value>"
            for k, v in a.items()) + "</tool_call>" for n, a in calls)
    if p.format is Format.HERMES:
        return "\n".join(f"<tool_call>\n{dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    assert p.dsv3 is not None
    tok = f.tokenizer.id_to_token
    cb, ce, sep = tok(p.dsv3.call_begin), tok(p.dsv3.call_end), tok(p.dsv3.sep)
    if p.dsv3.fenced:
        body = [f"{cb}function{sep}{n}\n```json\n{dumps(a)}\n```{ce}" for n, a in calls]
    else:
        body = [f"{cb}{n}{sep}{dumps(a)}{ce}" for n, a in calls]
    return f"{tok(p.dsv3.calls_begin)}{''.join(body)}{tok(p.dsv3.calls_end)}"


def grammar(f: Fam, function: str | None = None, parallel: bool = True, tools: list[Any] = TOOLS) -> Any:
    lark = call_syntax_grammar(f.profile, tools, function, parallel)
    return f.grammars.compile(GrammarSpec(GrammarKind.GRAMMAR, lark))


def accepted(f: Fam, compiled: Any, ids: list[int]) -> bool:
    """Every id allowed by the mask before it is consumed, then EOS allowed at the end."""
    matcher = f.grammars.backend.matcher(compiled)
    mask = new_bitmask(1, f.tokenizer.vocab_size)
    for token in [*ids, f.eos]:
        matcher.fill_bitmask(mask, 0)
        if not unpack(mask, f.tokenizer.vocab_size)[0, token]:
            return False
        assert matcher.consume(token)
    return True


def parsed(f: Fam, ids: list[int], tools: list[Any] = TOOLS) -> list[tuple[str, Any]]:
    agg = aggregate([*make_parser(f.profile, ParserOptions(schemas=tool_schemas(tools))).feed([*ids, f.eos])])
    assert agg.content.strip() == "" and not agg.invalid_calls, agg
    return [(c.name, json.loads(c.arguments)) for c in agg.tool_calls if c.complete]


# ---- valid and invalid outputs ---------------------------------------------------------------------

@pytest.mark.parametrize("case", list(VALID))
def test_every_valid_call_text_is_accepted_token_by_token_and_parses_back(fam: Fam, case: str) -> None:
    calls = VALID[case]
    ids = fam.encode(render(fam, calls))
    assert accepted(fam, grammar(fam), ids)
    assert parsed(fam, ids) == calls
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    if len(calls) == 1:  # a named function accepts its own call
        assert accepted(fam, grammar(fam, function=calls[0][0]), ids)


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_outputs_are_refused(fam: Fam, case: str) -> None:
    value = INVALID[case]
    text = value if isinstance(value, str) else (value[0] + render(fam, value[1]) if isinstance(value, tuple)
                                                  else render(fam, value))
    assert not accepted(fam, grammar(fam), fam.encode(text))


def test_a_named_function_refuses_calls_to_others_and_a_second_call(fam: Fam) -> None:
    compiled = grammar(fam, function="get_time")
    assert accepted(fam, compiled, fam.encode(render(fam, [("get_time", {"tz": "Europe/Paris"})])))
    assert not accepted(fam, compiled, fam.encode(render(fam, [("get_weather", {"city": "Paris"})])))
    twice = [("get_time", {"tz": "Europe/Paris"})] * 2
    assert not accepted(fam, compiled, fam.encode(render(fam, twice)))
    assert not accepted(fam, grammar(fam, parallel=False), fam.encode(render(fam, twice)))
    assert accepted(fam, grammar(fam), fam.encode(render(fam, twice)))


# ---- a scripted model under the masks --------------------------------------------------------------

BOUNDED = [fn("get_weather", {"city": {"type": "string", "maxLength": 8},
                              "days": {"type": "integer", "minimum": 1, "maximum": 7}}, ["city", "days"]),
           fn("get_time", {"tz": {"type": "string", "enum": ["Europe/Paris", "Asia/Tokyo"]}}, ["tz"])]


def forced(f: Fam, compiled: Any, script: list[int], limit: int = 200) -> list[int]:
    """What the scripted model (pdserve/models/scripted.py: logit 100 on the script's next id,
    then EOS; back to the script's start after any other id) samples greedily under the masks."""
    matcher = f.grammars.backend.matcher(compiled)
    mask = new_bitmask(1, f.tokenizer.vocab_size)
    out: list[int] = []
    pos = 0
    for _ in range(limit):
        logits = torch.zeros(f.tokenizer.vocab_size)
        logits[script[pos] if pos < len(script) else f.eos] = 100.0
        matcher.fill_bitmask(mask, 0)
        logits.masked_fill_(~unpack(mask, f.tokenizer.vocab_size)[0], float("-inf"))
        token = int(torch.argmax(logits))
        if token == f.eos:
            return out
        pos = pos + 1 if pos < len(script) and token == script[pos] else 0
        assert matcher.consume(token)
        out.append(token)
    raise AssertionError(f"no EOS in {limit} tokens: {f.tokenizer.decode(out)!r}")


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_a_model_that_says_plain_text_is_forced_into_a_valid_call(fam: Fam, choice: str) -> None:
    function = None if choice == "required" else choice
    # parallel_tool_calls false: the scripted model's fallback (the lowest allowed id) would
    # otherwise chain calls where the separator's id is below EOS's
    compiled = grammar(fam, function=function, parallel=False, tools=BOUNDED)
    ids = forced(fam, compiled, fam.encode("Sure, it is sunny in Paris."))
    calls = parsed(fam, ids, BOUNDED)
    assert calls and (function is None or [n for n, _ in calls] == [function])
    for name, arguments in calls:
        jsonschema.validate(arguments, {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}[name])


def test_a_model_that_calls_another_function_is_forced_to_the_named_one(fam: Fam) -> None:
    script = fam.encode(render(fam, [("get_weather", {"city": "Paris", "days": 3})]))
    ids = forced(fam, grammar(fam, function="get_time", tools=BOUNDED), script)
    [(name, arguments)] = parsed(fam, ids, BOUNDED)
    assert name == "get_time" and arguments["tz"] in ("Europe/Paris", "Asia/Tokyo")


def test_a_valid_call_passes_the_grammar_unchanged(fam: Fam) -> None:
    calls = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "Asia/Tokyo"})]
    script = fam.encode(render(fam, calls))
    assert forced(fam, grammar(fam, tools=BOUNDED), script) == script


# ---- what cannot be written --------------------------------------------------------------------------

def test_a_string_pattern_is_json_in_dsml_and_refused_by_glm_which_writes_strings_raw(fam: Fam) -> None:
    tools = [fn("f", {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, ["code"])]
    if fam.profile.format is Format.GLM:
        with pytest.raises(ToolGrammarError, match="GLM writes string values raw"):
            call_syntax_grammar(fam.profile, tools, None, True)
        return
    compiled = grammar(fam, tools=tools)
    assert accepted(fam, compiled, fam.encode(render(fam, [("f", {"code": "ABC"})]).replace(
        'string="true">ABC', 'string="false">"ABC"')))
    assert not accepted(fam, compiled, fam.encode(render(fam, [("f", {"code": "abc"})]).replace(
        'string="true">abc', 'string="false">"abc"')))


# ---- the router's side: the policy, the 400, where the grammar starts -----------------------------

def chat(**fields: Any) -> Any:
    from pdserve.frontend.protocol import ChatCompletionRequest

    return ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}], **fields)


def test_tool_choice_becomes_a_grammar_of_the_models_syntax_or_a_400_naming_tool_choice(fam: Fam) -> None:
    from pdserve.frontend.errors import APIError
    from pdserve.frontend.tools import ToolPolicy, json_calls, output_constraint

    spec, field = output_constraint(chat(tools=TOOLS, tool_choice="required"), ToolPolicy.of(chat(
        tools=TOOLS, tool_choice="required")), fam.profile)
    assert (spec.kind, field, json_calls(field, fam.profile)) == (GrammarKind.GRAMMAR, "tools", False)
    assert output_constraint(chat(tools=TOOLS), ToolPolicy.of(chat(tools=TOOLS)), fam.profile) is None  # auto
    pattern = [fn("f", {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, ["code"])]
    policy = ToolPolicy.of(chat(tools=pattern, tool_choice="required"))
    if fam.profile.format is Format.GLM:
        with pytest.raises(APIError) as e:
            policy.call_grammar(fam.profile)
        assert (e.value.status, e.value.param) == (400, "tool_choice") and "GLM writes string" in str(e.value)
    else:
        assert policy.call_grammar(fam.profile) is not None


def test_the_grammar_starts_after_the_prompts_reasoning_or_lets_the_model_open_one(fam: Fam) -> None:
    from pdserve.frontend.tools import ToolPolicy, for_prompt

    think = fam.profile.think
    if think is None:
        pytest.skip(f"{fam.name} has no reasoning markers, so no reasoning for the grammar to start after")
    req = chat(tools=TOOLS, tool_choice="required")
    policy = ToolPolicy.of(req)
    constraint = (policy.call_grammar(fam.profile), "tools")
    prompt = fam.encode("<|im_start|>assistant\n")
    opened = for_prompt(constraint, policy, fam.profile, [*prompt, think.start])
    closed = for_prompt(constraint, policy, fam.profile, [*prompt, think.start, think.end, *fam.encode("\n\n")])
    left = for_prompt(constraint, policy, fam.profile, prompt)
    assert (opened.start_after, opened.value) == (think.end, constraint[0].value)
    assert (closed.start_after, closed.value) == (None, constraint[0].value)
    assert left.start_after is None and left.value.startswith("start: reasoning? ")
    reasoning = fam.encode("<think>\nPlan.\n</think>\n\n") if fam.profile.format is Format.HERMES else \
        [think.start, *fam.encode("Plan."), think.end]
    compiled = fam.grammars.compile(left)
    calls = fam.encode(render(fam, [("get_time", {"tz": "Asia/Tokyo"})]))
    assert accepted(fam, compiled, [*reasoning, *calls]) and accepted(fam, compiled, calls)


# ---- "auto" with strict tools ----------------------------------------------------------------------

def test_auto_with_strict_tools_allows_text_and_holds_each_call_to_its_schema(fam: Fam) -> None:
    def compiled(parallel: bool) -> Any:
        lark = call_syntax_grammar(fam.profile, TOOLS, None, parallel, optional=True)
        return fam.grammars.compile(GrammarSpec(GrammarKind.GRAMMAR, lark))

    calls = render(fam, VALID["V01"])
    auto, single = compiled(True), compiled(False)
    for text in ("Sure, a<b and </div> here.", calls, "Let me check." + calls + "\n\nDone.", "A" + calls + "B" + calls):
        assert accepted(fam, auto, fam.encode(text)), text
    think = fam.profile.think
    assert think is None or accepted(fam, auto, [think.start, *fam.encode("Plan."), think.end, *fam.encode(calls)])
    assert not accepted(fam, auto, fam.encode("Hi" + render(fam, [("get_weather", {"days": 3})])))
    assert not accepted(fam, auto, fam.encode("Hi" + render(fam, [("nope", {})])))
    assert accepted(fam, single, fam.encode("A" + calls)) and not accepted(fam, single, fam.encode(calls + calls))


def test_auto_is_constrained_only_when_every_tool_is_strict_or_with_a_response_format(fam: Fam) -> None:
    from pdserve.frontend.tools import ToolPolicy, output_constraint

    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    assert ToolPolicy.of(chat(tools=TOOLS)).call_grammar(fam.profile) is None
    req = chat(tools=strict)
    assert output_constraint(req, ToolPolicy.of(req), fam.profile)[1] == "tools"
    for tools in (TOOLS, strict):  # the calls, or the answer in the format: one grammar
        req = chat(tools=tools, response_format={"type": "json_object"})
        spec, field = output_constraint(req, ToolPolicy.of(req), fam.profile)
        assert field == "tools" and '%json {"type": "object"' in spec.value
    req = chat(tools=strict, structured_outputs={"regex": "[a-z]+"})  # the raw output's shape wins
    assert output_constraint(req, ToolPolicy.of(req), fam.profile)[1] == "structured_outputs"


# ---- "auto" with a response_format -----------------------------------------------------------------

ANSWER = {"type": "object", "properties": {"city": {"type": "string"}, "summary": {"type": "string"}},
          "required": ["city", "summary"], "additionalProperties": False}


def answer_grammar(fam: Fam, opens_reasoning: bool = False, parallel: bool = True) -> Any:
    from pdserve.frontend.tools import ToolPolicy

    req = chat(tools=TOOLS, parallel_tool_calls=parallel, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER, "strict": True}})
    spec = ToolPolicy.of(req).call_grammar(fam.profile, model_opens_reasoning=opens_reasoning)
    assert spec is not None
    return fam.grammars.compile(spec)


def test_auto_with_a_response_format_writes_calls_or_the_answer_in_its_format(fam: Fam) -> None:
    compiled = answer_grammar(fam)
    answer = json.dumps({"city": "Paris", "summary": "Sunny"}, separators=(",", ":"))
    for calls in VALID.values():
        assert accepted(fam, compiled, fam.encode(render(fam, calls)))
    assert accepted(fam, compiled, fam.encode(answer))
    refused = ["Sunny in Paris.", json.dumps({"city": "Paris", "summary": "Sunny"}),  # not compact
               '{"city":"Paris"}', answer + render(fam, VALID["V01"]), "Let me check." + render(fam, VALID["V01"]),
               render(fam, [("get_weather", {"days": 3})])]
    for text in refused:
        assert not accepted(fam, compiled, fam.encode(text)), text
    single = answer_grammar(fam, parallel=False)
    assert not accepted(fam, single, fam.encode(render(fam, VALID["V03"])))
    assert accepted(fam, single, fam.encode(render(fam, VALID["V01"])))
    think = fam.profile.think
    if think is not None:  # a model that opens its reasoning itself may, before either
        reasoning = [think.start, *fam.encode("Plan."), think.end]
        left = answer_grammar(fam, opens_reasoning=True)
        assert accepted(fam, left, [*reasoning, *fam.encode(answer)])
        assert accepted(fam, left, [*reasoning, *fam.encode(render(fam, VALID["V01"]))])


def test_a_forced_call_sets_response_format_aside_but_not_structured_outputs(fam: Fam) -> None:
    from pdserve.frontend.errors import APIError
    from pdserve.frontend.tools import ToolPolicy, output_constraint

    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        alone = chat(tools=TOOLS, tool_choice=choice)
        req = chat(tools=TOOLS, tool_choice=choice, response_format={"type": "json_object"})
        assert output_constraint(req, ToolPolicy.of(req), fam.profile) == \
            output_constraint(alone, ToolPolicy.of(alone), fam.profile)
        req = chat(tools=TOOLS, tool_choice=choice, structured_outputs={"regex": "[a-z]+"})
        with pytest.raises(APIError) as e:
            output_constraint(req, ToolPolicy.of(req), fam.profile)
        assert (e.value.status, e.value.param) == (400, "tools") and "only one output constraint" in str(e.value)
