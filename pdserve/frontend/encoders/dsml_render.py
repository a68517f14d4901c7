"""Pieces shared by the DeepSeek V3.2 and V4 prompt encoders: DSML tool-call blocks, JSON and
OpenAI message fields.

The assistant's tool calls are rendered back exactly as the model writes them (strings verbatim
with string="true", everything else as JSON with string="false"), so that history looks like
the model's own output and parses back to the same calls.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

DSML = "\uff5cDSML\uff5c"
BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
USER = "<\uff5cUser\uff5c>"
ASSISTANT = "<\uff5cAssistant\uff5c>"
THINK_START, THINK_END = "<think>", "</think>"
RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"

Message = Mapping[str, Any]


class EncodeError(ValueError):
    """The conversation cannot be rendered for this model (the API answers 400)."""


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def text_of(content: Any) -> str:
    """OpenAI content (a string, None, or a list of parts) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise EncodeError(f"content part of type {kind!r} is not supported by this model")
    return "\n".join(parts)


def reasoning_of(msg: Message) -> str:
    return text_of(msg.get("reasoning_content") or msg.get("reasoning"))


def functions_of(tools: Sequence[Mapping[str, Any]] | None) -> list[Any]:
    """The `function` objects of OpenAI tools (what the reference renders into the prompt)."""
    out = []
    for tool in tools or ():
        if "function" not in tool:
            raise EncodeError(f"tool without a function: {tool!r}")
        out.append(tool["function"])
    return out


def calls_of(msg: Message) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments object) of an assistant message's OpenAI tool calls."""
    calls = []
    for call in msg.get("tool_calls") or ():
        fn = call.get("function", call)
        arguments = fn.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as err:
                raise EncodeError(f"tool call arguments are not JSON: {arguments[:80]!r}") from err
        if not isinstance(arguments, Mapping):
            raise EncodeError(f"tool call arguments must be a JSON object, got {type(arguments).__name__}")
        calls.append((str(fn.get("name", "")), dict(arguments)))
    return calls


def render_parameter(key: str, value: Any) -> str:
    string = isinstance(value, str)
    body = value if string else to_json(value)
    flag = "true" if string else "false"
    return f'<{DSML}parameter name="{key}" string="{flag}">{body}</{DSML}parameter>'


def render_invoke(name: str, arguments: Mapping[str, Any]) -> str:
    params = "\n".join(render_parameter(k, v) for k, v in arguments.items())
    return f'<{DSML}invoke name="{name}">\n{params}\n</{DSML}invoke>'


def render_calls_block(calls: Sequence[tuple[str, Mapping[str, Any]]], block_name: str) -> str:
    """`\\n\\n<｜DSML｜BLOCK>…</｜DSML｜BLOCK>`, or "" when there are no calls."""
    if not calls:
        return ""
    invokes = "\n".join(render_invoke(name, args) for name, args in calls)
    return f"\n\n<{DSML}{block_name}>\n{invokes}\n</{DSML}{block_name}>"


def with_tools(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None,
               response_format: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Request-level tools and response format go on the system message (one is inserted at
    the front when the conversation has none), where the reference encoders render them."""
    out = [dict(m) for m in messages]
    if not tools and not response_format:
        return out
    index = next((i for i, m in enumerate(out) if m.get("role") == "system"), None)
    if index is None:
        out.insert(0, {"role": "system", "content": ""})
        index = 0
    if tools:
        out[index]["tools"] = list(tools)
    if response_format:
        out[index]["response_format"] = response_format
    return out


def message_extras(msg: Message, tools_prompt: Callable[[Sequence[Mapping[str, Any]]], str]) -> str:
    """What a system or user message carries after its text: the tools (in the version's own
    words, `tools_prompt`) and the response format."""
    text = ""
    if msg.get("tools"):
        text += "\n\n" + tools_prompt(msg["tools"])
    if msg.get("response_format"):
        text += "\n\n" + RESPONSE_FORMAT.format(schema=to_json(msg["response_format"]))
    return text


def last_user_index(messages: Sequence[Message]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)


def thinking_from_kwargs(chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """`chat_template_kwargs.thinking` (DeepSeek, SGLang); `enable_thinking` is accepted too."""
    kwargs = chat_template_kwargs or {}
    return bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))
