"""Tool calling at the router, without workers: the request fields, the tool policy, prompts
with tools for each model family, the chat decoder (parser + stop strings) and its stream
chunks, with the real tokenizers and the scripted outputs of tests/frontend/scripted.py."""
from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.frontend.choices import Batch, ChoiceEvent, DeltaBatcher
from pdserve.frontend.errors import APIError
from pdserve.frontend.output import ChatOutput, OutputDelta
from pdserve.frontend.prompts import PromptBuilder, PromptStyle
from pdserve.frontend.protocol import ChatCompletionRequest
from pdserve.frontend.render import ChatRenderer
from pdserve.frontend.tools import ToolPolicy
from pdserve.parsers import ParamSchema, ProfileError, ToolCallArgs, ToolCallStart, ToolsMode
from pdserve.tokenizer import Tokenizer

from tests.frontend.scripted import (CALLS, CONTENT, DSML, FAMILIES, MESSAGES, REASONING, TOOLS, script_ids,
                                     write_scripted_model, write_tokenizer)

DSML_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "days": 2}'}}
HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [DSML_CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": MESSAGES, **fields})


class Model:
    """A family's scripted model directory, its router-side tokenizer and chat output."""

    def __init__(self, name: str, root: Path) -> None:
        self.family = FAMILIES[name]
        self.dir = write_scripted_model(self.family, root / name)
        self.tokenizer = Tokenizer(self.dir)
        self.output = ChatOutput.load(self.dir, self.tokenizer)
        self.prompts = PromptBuilder(self.tokenizer)
        eos = json.loads((self.dir / "config.json").read_text())["eos_token_id"]
        self.ids = script_ids(self.dir) + [eos]

    def prompt(self, req: ChatCompletionRequest) -> Any:
        return asyncio.run(self.prompts.chat(req, ToolPolicy.of(req).prompt_tools, self.output.prompt_style))

    def run(self, req: ChatCompletionRequest, batch: int = 1, ids: list[int] | None = None,
            reason: str = "stop", diagnostics: list[str] | None = None) -> tuple[list[dict[str, Any]], dict]:
        """The choice's stream chunks and its non-streaming body, as the router makes them."""
        policy = ToolPolicy.of(req)
        self.output.on_diagnostic = diagnostics.append if diagnostics is not None else None
        dec = self.output.decoder(self.prompt(req).ids, req.stop_list(), policy)
        renderer = ChatRenderer("chatcmpl-t", "m", 1, 1, self.tokenizer)
        batcher, chunks, n = DeltaBatcher(batch), [], 0
        for token_id in self.ids if ids is None else ids:
            n += 1
            out = batcher.add(token_id, dec.push(token_id))
            if out is not None:
                chunks += renderer.absorb(ChoiceEvent(0, out, num_tokens=n))
            if dec.stopped:
                break
        batcher.add_text(dec.finish(reason))
        chunks += renderer.absorb(ChoiceEvent(0, batcher.take(), dec.finish_reason, num_tokens=n))
        return chunks, renderer.response()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Model]:
    root = tmp_path_factory.mktemp("tools")
    return functools.cache(lambda name: Model(name, root))


@pytest.fixture(params=list(FAMILIES))
def model(request: pytest.FixtureRequest, models: Callable[[str], Model]) -> Model:
    return models(request.param)


def accumulated(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What openai-python's accumulator makes of the chunks."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate({"created": 0, **chunk}))
    choice = state.current_completion_snapshot.choices[0]  # get_final_completion() refuses "length"
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return {"content": choice.message.content or "", "reasoning": getattr(choice.message, "reasoning_content", ""),
            "calls": calls, "finish_reason": choice.finish_reason}


def plain(body: dict[str, Any]) -> dict[str, Any]:
    choice = body["choices"][0]
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return {"content": message["content"] or "", "reasoning": message.get("reasoning_content", ""),
            "calls": calls, "finish_reason": choice["finish_reason"]}


# ---- the request fields ----------------------------------------------------------------------


ALLOWED_TIME = {"type": "allowed_tools", "allowed_tools": {
    "mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}


@pytest.mark.parametrize("fields, message", [
    ({"tool_choice": "required"}, "needs a non-empty tools list"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "needs a non-empty tools list"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "custom", "custom": {"name": "x"}}}, "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "Input should be"),
    ({"tool_choice": ALLOWED_TIME}, "needs a non-empty tools list"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]}}}, "not in tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
     "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "sometimes", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}},
     "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {"name": 'say "hi"'}}]}, "function.name must be"),
    ({"tools": [{"type": "code_interpreter"}]}, "only tools of type 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "JSON Schema object"),
])
def test_malformed_tool_fields_are_a_400_naming_the_problem(no_worker_client, fields, message) -> None:
    from tests.frontend.router_cases import API_KEY

    r = no_worker_client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"messages": MESSAGES, **fields})
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_policy_emits_calls_only_with_tools_and_a_choice_other_than_none() -> None:
    assert not ToolPolicy.of(request()).emit
    assert ToolPolicy.of(request(tools=TOOLS)).emit
    none = ToolPolicy.of(request(tools=TOOLS, tool_choice="none"))
    assert not none.emit and none.prompt_tools is None  # the prompt has no tools either
    named = ToolPolicy.of(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.required and named.function == "get_time"
    allowed = ToolPolicy.of(request(tools=TOOLS, tool_choice=ALLOWED_TIME))
    assert (allowed.required, allowed.function, allowed.allowed) == (True, None, {"get_time"})
    assert allowed.prompt_tools == TOOLS and [t["function"]["name"] for t in allowed.callable_tools] == ["get_time"]
    assert ToolPolicy.of(request(tools=TOOLS, parallel_tool_calls=None)).parallel
    assert not ToolPolicy.of(request(tools=TOOLS, parallel_tool_calls=False)).parallel


def test_policy_parser_options(model: Model) -> None:
    req = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                  parallel_tool_calls=False, separate_reasoning=False)
    opts = ToolPolicy.of(req).parser_options(model.output.profile, [], frozenset({7}), "call_x")
    assert opts.tools_mode is ToolsMode.EMIT and opts.max_calls == 1 and not opts.separate_reasoning
    assert opts.known_tools == {"get_time"} and opts.drop_unknown_tools and opts.stop_ids == {7}
    assert opts.schemas["get_weather"] == {"city": ParamSchema("string"), "days": ParamSchema("integer")}
    assert ToolPolicy.of(request()).parser_options(model.output.profile, [], frozenset(), "c").tools_mode \
        is ToolsMode.SUPPRESS


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}, ALLOWED_TIME])
def test_required_and_named_choices_fail_only_when_the_model_stopped_without_a_call(choice) -> None:
    policy = ToolPolicy.of(request(tools=TOOLS, tool_choice=choice))
    policy.check("tool_calls", 1, [])
    policy.check("length", 0, [])  # cut by max_tokens: answered as it is
    with pytest.raises(APIError) as e:
        policy.check("stop", 0, ["get_weather"])
    assert (e.value.status, e.value.code) == (500, "tool_choice_not_satisfied")
    assert "'get_weather'" in e.value.message
    ToolPolicy.of(request(tools=TOOLS)).check("stop", 0, [])  # auto: no requirement


# ---- start-up -------------------------------------------------------------------------------


def test_a_tokenizer_without_the_family_markers_refuses_to_start(tmp_path: Path) -> None:
    write_tokenizer("deepseek-v3.2", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4_moe"}))
    with pytest.raises(ProfileError, match="'<tool_call>' is not a single token.*refusing to start"):
        ChatOutput.load(tmp_path, Tokenizer(tmp_path))


def test_a_qwen_model_from_before_tool_calls_gets_plain_output(tmp_path: Path) -> None:
    write_tokenizer("deepseek-v3.2", tmp_path)  # no <tool_call> token
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert ChatOutput.load(tmp_path, Tokenizer(tmp_path)).profile.name == "plain"


def test_profiles_come_from_config_json(model: Model) -> None:
    names = {"deepseek_v32": "deepseek_v32", "deepseek_v4": "deepseek_v4", "glm4_moe": "glm", "qwen3": "hermes"}
    assert model.output.profile.name == names[model.family.model_type]
    assert model.output.parsed


# ---- prompts --------------------------------------------------------------------------------


def test_tools_are_in_the_prompt_unless_tool_choice_is_none(model: Model) -> None:
    with_tools = model.prompt(request(tools=TOOLS)).text
    assert "get_weather" in with_tools and "Weather forecast for a city" in with_tools
    assert "get_weather" not in model.prompt(request(tools=TOOLS, tool_choice="none")).text
    assert "get_weather" not in model.prompt(request()).text


def test_assistant_tool_calls_and_results_are_rendered_back(model: Model) -> None:
    text = model.prompt(request(messages=HISTORY, tools=TOOLS, chat_template_kwargs=model.family.thinking)).text
    style = model.output.prompt_style
    if style is PromptStyle.TEMPLATE and model.family.key.startswith("glm"):
        assert "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>" in text
        assert "<tool_response>cold</tool_response>" in text
    elif style is PromptStyle.TEMPLATE:
        assert '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}' in text
        assert "cold" in text
    else:
        assert f'<{DSML}parameter name="city" string="true">Oslo</{DSML}parameter>' in text
        assert f'<{DSML}parameter name="days" string="false">2</{DSML}parameter>' in text
        assert "<result>cold</result>" in text or "<tool_result>cold</tool_result>" in text


@pytest.mark.parametrize("name", ["v32", "v4"])
def test_deepseek_thinking_comes_from_chat_template_kwargs(models: Callable[[str], Model], name: str) -> None:
    m = models(name)
    assert m.output.prompt_style is not PromptStyle.TEMPLATE  # the reference encoders, not a template
    assert m.prompt(request(chat_template_kwargs={"thinking": True})).text.endswith("<think>")
    assert m.prompt(request()).text.endswith("</think>")
    with pytest.raises(APIError, match="continue_final_message"):
        m.prompt(request(messages=[*MESSAGES, {"role": "assistant", "content": "Hm"}],
                         continue_final_message=True, add_generation_prompt=False))


def test_reasoning_effort_reaches_the_deepseek_v4_prompt(models: Callable[[str], Model]) -> None:
    m = models("v4")
    thinking = {"thinking": True}
    top = m.prompt(request(chat_template_kwargs=thinking, reasoning_effort="max")).text
    assert top == m.prompt(request(chat_template_kwargs={**thinking, "reasoning_effort": "max"})).text
    assert top != m.prompt(request(chat_template_kwargs=thinking)).text  # max adds its preamble
    # chat_template_kwargs win over the top-level field; "none" is the default effort
    assert m.prompt(request(chat_template_kwargs={**thinking, "reasoning_effort": "high"},
                            reasoning_effort="max")).text == m.prompt(request(chat_template_kwargs=thinking)).text
    assert m.prompt(request(chat_template_kwargs=thinking, reasoning_effort="none")).text == m.prompt(
        request(chat_template_kwargs=thinking)).text


def test_arguments_that_are_not_a_json_object_are_a_400(model: Model) -> None:
    bad = {**DSML_CALL, "function": {"name": "get_weather", "arguments": "[1, 2]"}}
    with pytest.raises(APIError) as e:
        model.prompt(request(messages=[HISTORY[0], {"role": "assistant", "tool_calls": [bad]}, HISTORY[2]]))
    assert e.value.status == 400


# ---- the decoder and its chunks ---------------------------------------------------------------


def test_the_script_parses_into_reasoning_content_and_calls(model: Model) -> None:
    chunks, body = model.run(request(tools=TOOLS, chat_template_kwargs=model.family.thinking or None))
    result = plain(body)
    assert (result["reasoning"], result["content"], result["finish_reason"]) == (REASONING, CONTENT, "tool_calls")
    assert [(n, json.loads(a)) for n, a in result["calls"]] == CALLS
    assert body["choices"][0]["message"]["reasoning"] == REASONING


@pytest.mark.parametrize("batch", range(1, 9))
def test_every_stream_batch_accumulates_to_the_non_streaming_message(model: Model, batch: int) -> None:
    req = request(tools=TOOLS, chat_template_kwargs=model.family.thinking or None)
    _, body = model.run(req)
    chunks, _ = model.run(req, batch)
    assert accumulated(chunks) == plain(body)


def test_chunks_keep_the_order_of_reasoning_content_and_calls(model: Model) -> None:
    """The first token goes alone, the rest is one batch: one chunk per run of a kind."""
    chunks, _ = model.run(request(tools=TOOLS, chat_template_kwargs=model.family.thinking or None), batch=1 << 20)
    kinds = []
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        call = (delta.get("tool_calls") or [{}])[0]
        kinds.append("reasoning" if "reasoning_content" in delta else "content" if "content" in delta
                     else "start" if "id" in call else "args")
    assert kinds[-6:] == ["reasoning", "content", "start", "args", "start", "args"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[-6:]] == [None] * 5 + ["tool_calls"]


def test_without_tools_every_call_is_counted_as_suppressed(model: Model) -> None:
    seen: list[str] = []
    _, body = model.run(request(chat_template_kwargs=model.family.thinking or None), diagnostics=seen)
    assert plain(body)["calls"] == [] and plain(body)["content"] == CONTENT
    assert seen.count("suppressed") == 2


def test_max_tokens_inside_a_call_gives_length_and_an_unclosed_call(model: Model) -> None:
    req = request(tools=TOOLS, chat_template_kwargs=model.family.thinking or None)
    full = plain(model.run(req)[1])["calls"][0][1]
    cut = next(k for k in range(len(model.ids)) if "Paris" in model.tokenizer.decode(model.ids[:k]))
    chunks, body = model.run(req, batch=3, ids=model.ids[:cut], reason="length")
    result = plain(body)
    assert result["finish_reason"] == "length" and accumulated(chunks) == result
    if model.family.atomic:
        assert result["calls"] == []
    else:
        [(name, arguments)] = result["calls"]
        assert name == "get_weather" and full.startswith(arguments) and arguments.endswith("Paris")


def test_a_stop_string_prefix_is_released_when_a_call_begins(model: Model) -> None:
    req = request(tools=TOOLS, stop=["both.!", "Europe"], chat_template_kwargs=model.family.thinking or None)
    result = plain(model.run(req)[1])
    assert result["content"] == CONTENT  # "both." was held as a possible "both.!", then released
    assert len(result["calls"]) == 2  # "Europe" is inside a call: stop strings apply to content


def test_a_stop_string_in_content_ends_the_choice(model: Model) -> None:
    chunks, body = model.run(request(tools=TOOLS, stop=["check"], chat_template_kwargs=model.family.thinking or None),
                             batch=2)
    assert plain(body) == {"content": "Let me ", "reasoning": REASONING, "calls": [], "finish_reason": "stop"}
    assert accumulated(chunks) == plain(body)


def test_unsatisfied_required_choice_raises_at_the_end(model: Model) -> None:
    news = {"type": "function", "function": {"name": "get_news"}}
    req = request(tools=[*TOOLS, news], tool_choice={"type": "function", "function": {"name": "get_news"}},
                  chat_template_kwargs=model.family.thinking or None)
    with pytest.raises(APIError, match="get_news.*it called 'get_weather', 'get_time' instead"):
        model.run(req)


def test_output_delta_keeps_plain_text_compatible() -> None:
    delta = OutputDelta("Hi")
    delta.extend(OutputDelta(parts=[ToolCallStart(0, "call_0", "f"), ToolCallArgs(0, "{}")]))
    assert delta.content == "Hi" and len(delta.parts) == 3 and bool(delta) and not OutputDelta()


def test_a_call_only_message_has_null_content() -> None:
    renderer = ChatRenderer("chatcmpl-t", "m", 1, 1, None)
    delta = OutputDelta(parts=[ToolCallStart(0, "call_0", "f"), ToolCallArgs(0, "{}")])
    chunks = renderer.absorb(ChoiceEvent(0, Batch(delta, [1, 2]), "tool_calls", num_tokens=2))
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    message = renderer.response()["choices"][0]["message"]
    call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert message == {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}
