"""DeepSeek V3/R1/V3.1 tool calling at the router, and what every family does with a call that
EOS cuts, without workers: prompts through the real bundled templates (tools in the system
prompt, OpenAI shapes kept), the `--tool-call-parser` flag, and the decoder and renderer fed
the real tokenizers' ids."""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli import build_parser
from pdserve.frontend.output import ChatOutput
from pdserve.frontend.prompts import PromptBuilder, PromptStyle
from pdserve.parsers import ProfileError
from pdserve.tokenizer import Tokenizer

from tests.frontend.scripted import CALLS, CONTENT, FAMILIES, MESSAGES, TOOLS, Family, script_ids, write_scripted_model
from tests.frontend.test_tools import HISTORY, Model, accumulated, plain, request
from tests.frontend.test_tools_dsv3_e2e import EOS, SCRIPTS, SEP

DSV3 = {"v3": Family("deepseek-v3", "deepseek_v3", EOS, SCRIPTS["v3"][1][0]),
        "v31": Family("deepseek-v3.1", "deepseek_v3", EOS, SCRIPTS["v31"][1][0]),
        "r1": Family("deepseek-r1", "deepseek_v3", EOS, SCRIPTS["v3"][1][0])}
ALL = {**FAMILIES, **DSV3}


class ScriptedModel(Model):
    """test_tools.Model for any family here (the V3 ones too)."""

    def __init__(self, name: str, root: Path) -> None:
        self.family = ALL[name]
        self.dir = write_scripted_model(self.family, root / name)
        self.tokenizer = Tokenizer(self.dir)
        self.output = ChatOutput.load(self.dir, self.tokenizer)
        self.prompts = PromptBuilder(self.tokenizer)
        self.eos = json.loads((self.dir / "config.json").read_text())["eos_token_id"]
        self.ids = script_ids(self.dir) + [self.eos]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], ScriptedModel]:
    root = tmp_path_factory.mktemp("dsv3")
    return functools.cache(lambda name: ScriptedModel(name, root))


# ---- profiles and the flag ----------------------------------------------------------------------


@pytest.mark.parametrize("name, profile, style", [("v3", "deepseek_v3", PromptStyle.DSV3),
                                                  ("r1", "deepseek_v3", PromptStyle.DSV3),
                                                  ("v31", "deepseek_v31", PromptStyle.DSV31)])
def test_v3_families_resolve_from_the_tokenizer_and_template(models, name: str, profile: str,
                                                             style: PromptStyle) -> None:
    m = models(name)
    assert (m.output.profile.name, m.output.prompt_style) == (profile, style)


def test_the_flag_overrides_the_resolution(models) -> None:
    m = models("v31")
    assert ChatOutput.load(m.dir, m.tokenizer, "deepseek_r1").profile.name == "deepseek_v3"
    assert ChatOutput.load(m.dir, m.tokenizer, "DeepSeek-V3.1").profile.name == "deepseek_v31"
    assert ChatOutput.load(m.dir, m.tokenizer, "none").profile.name == "plain"
    with pytest.raises(ProfileError, match="marker '<tool_call>' is not a single token"):
        ChatOutput.load(m.dir, m.tokenizer, "hermes")


@pytest.mark.parametrize("command", ["serve", "router"])
def test_an_unknown_parser_name_is_refused_by_the_command_line(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--tool-call-parser", "deepseek_v9"])
    assert e.value.code == 2
    assert "unknown tool-call parser 'deepseek_v9'; one of deepseek_r1, deepseek_v3" in capsys.readouterr().err
    args = build_parser().parse_args([command, "--tool-call-parser", "deepseek-v3.1"])
    assert args.tool_call_parser == "deepseek-v3.1"


# ---- prompts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["v3", "r1", "v31"])
def test_the_tools_are_in_the_system_prompt_with_the_call_format(models, name: str) -> None:
    m = models(name)
    text = m.prompt(request(tools=TOOLS)).text
    schema = json.dumps(TOOLS[0]["function"]["parameters"])
    assert "## Tools\n" in text and "### get_weather\nDescription: Weather forecast for a city" in text
    assert f"Parameters: {schema}" in text and "### get_time" in text
    assert text.index("## Tools") < text.index("<\uff5cUser\uff5c>")  # before the conversation
    call = f"function{SEP}NAME\n```json\nARGUMENTS\n```" if name != "v31" else f"NAME{SEP}ARGUMENTS"
    assert call in text
    assert "## Tools" not in m.prompt(request(tools=TOOLS, tool_choice="none")).text
    with_system = m.prompt(request(messages=[{"role": "system", "content": "Be brief."}, *MESSAGES], tools=TOOLS))
    assert "Be brief.\n\n## Tools\n" in with_system.text


@pytest.mark.parametrize("name", ["v3", "r1", "v31"])
def test_tool_calls_with_null_content_and_results_render_back(models, name: str) -> None:
    """The standard shapes: content null beside tool_calls, arguments a JSON string."""
    text = models(name).prompt(request(messages=HISTORY, tools=TOOLS)).text
    arguments = '{"city": "Oslo", "days": 2}'
    if name == "v31":
        assert f"<\uff5ctool\u2581call\u2581begin\uff5c>get_weather{SEP}{arguments}" in text
    else:
        assert f"function{SEP}get_weather\n```json\n{arguments}\n```" in text
    assert "<\uff5ctool\u2581output\u2581begin\uff5c>cold<\uff5ctool\u2581output\u2581end\uff5c>" in text
    assert "None" not in text


def test_v31_thinking_comes_from_chat_template_kwargs(models) -> None:
    m = models("v31")
    assert m.prompt(request(chat_template_kwargs={"thinking": True})).text.endswith("<think>")
    assert m.prompt(request()).text.endswith("</think>")


# ---- a call cut by EOS, in every family -------------------------------------------------------------


def cut_before(m: ScriptedModel, text: str) -> list[int]:
    """The script up to (not including) the first token holding `text`, then EOS."""
    ids = script_ids(m.dir)
    at = next(i for i, t in enumerate(ids) if text in m.tokenizer.decode([t]))
    return ids[:at] + [m.eos]


# The first call's report: (index, text). Hermes calls are released whole: nothing was sent.
CUT = {"v32": (0, '{"city": "'), "v4": (0, '{"city": "'), "glm": (0, '{"city": "'),
       "qwen": (None, '{"name": "get_weather", "arguments": {"city": "'),
       "v3": (0, '{"city": "'), "v31": (0, '{"city": "')}


@pytest.mark.parametrize("name", list(CUT))
def test_a_call_cut_by_eos_is_reported_apart_in_every_family(models, name: str) -> None:
    m = models(name)
    req = request(tools=TOOLS, chat_template_kwargs=m.family.thinking or None)
    chunks, body = m.run(req, ids=cut_before(m, "Paris"))
    result, message = plain(body), body["choices"][0]["message"]
    assert (result["calls"], result["finish_reason"], result["content"]) == ([], "stop", CONTENT)
    index, text = CUT[name]
    assert message["invalid_tool_calls"] == [{"index": index, "name": "get_weather", "text": text,
                                              "reason": "ended_inside_block"}]
    assert "tool_calls" not in message
    final = chunks[-1]["choices"][0]
    assert (final["finish_reason"], final["invalid_tool_calls"]) == ("stop", message["invalid_tool_calls"])
    assert all("invalid_tool_calls" not in c["choices"][0] for c in chunks[:-1])
    streamed = accumulated(chunks)  # OpenAI's own stream helper reads these chunks
    assert streamed["content"] == CONTENT and streamed["finish_reason"] == "stop"
    assert streamed["calls"] == ([] if index is None else [("get_weather", text)])  # the client drops it


def test_a_second_call_cut_by_eos_leaves_the_first(models) -> None:
    m = models("v31")
    ids = script_ids(m.dir)
    at = [i for i, t in enumerate(ids) if "Europe" in m.tokenizer.decode([t])][0]
    _, body = m.run(request(tools=TOOLS), ids=ids[:at] + [m.eos])
    message = body["choices"][0]["message"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == CALLS[:1]
    assert [(r["index"], r["name"]) for r in message["invalid_tool_calls"]] == [(1, "get_time")]
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_invalid_arguments_are_reported_not_returned(models) -> None:
    m = models("v31")
    bad = m.tokenizer.encode(f'<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>'
                             f'get_time{SEP}hello<\uff5ctool\u2581call\u2581end\uff5c>'
                             f'<\uff5ctool\u2581calls\u2581end\uff5c>', add_special_tokens=False)
    chunks, body = m.run(request(tools=TOOLS), ids=bad + [m.eos])
    message = body["choices"][0]["message"]
    assert (body["choices"][0]["finish_reason"], message["content"]) == ("stop", "")
    assert message["invalid_tool_calls"] == [{"index": 0, "name": "get_time", "text": "hello",
                                              "reason": "invalid_call"}]
