"""DeepSeek-V3.2 prompt encoder (the model ships an encoder instead of a Jinja template).

Format facts from DeepSeek's reference `encoding_dsv32.py` (docs/dsml.md, "DeepSeek-V3.2"): tools go into
the system prompt, assistant tool calls are rendered back as a DSML `function_calls` block, and
tool results follow the assistant turn by position in `<function_results>`. Thinking mode opens
`<think>` after the last user turn (or after its tool results) and drops older reasoning.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.frontend.encoders.dsml_render import (ASSISTANT, BOS, DSML, EOS, THINK_END,
                                                   THINK_START, USER, EncodeError, Message, calls_of,
                                                   functions_of, last_user_index, message_extras,
                                                   reasoning_of, render_calls_block, text_of, to_json,
                                                   with_tools)

BLOCK = "function_calls"


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    schemas = "\n".join(to_json(f) for f in functions_of(tools))
    return (
        "## Tools\n"
        "You have access to a set of tools you can use to answer the user's question.\n"
        f'You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part '
        "of your reply to the user:\n"
        f"<{DSML}function_calls>\n"
        f'<{DSML}invoke name="$FUNCTION_NAME">\n'
        f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
        "...\n"
        f"</{DSML}invoke>\n"
        f'<{DSML}invoke name="$FUNCTION_NAME2">\n'
        "...\n"
        f"</{DSML}invoke>\n"
        f"</{DSML}function_calls>\n"
        "String and scalar parameters should be specified as is without any escaping or quotes, while lists "
        'and objects should use JSON format. The "string" attribute should be set to "true" for string type '
        'parameters and "false" for other types (numbers, booleans, arrays, objects).\n'
        "If the thinking_mode is enabled, then after function results you should strongly consider outputting "
        "a thinking block. Here is an example:\n"
        f"<{DSML}function_calls>\n"
        "...\n"
        f"</{DSML}function_calls>\n"
        "<function_results>\n"
        "...\n"
        "</function_results>\n"
        f"{THINK_START}...thinking about results{THINK_END}\n"
        "Here are the functions available in JSONSchema format:\n"
        "<functions>\n"
        f"{schemas}\n"
        "</functions>\n"
    )


def encode_v32(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None, *,
               thinking: bool = False, response_format: Mapping[str, Any] | None = None,
               add_bos: bool = True, drop_thinking: bool = True) -> str:
    """The prompt text for a chat; it ends with `<｜Assistant｜><think>` or `…</think>` (or the
    same markers after tool results), so generation continues as the assistant."""
    msgs = with_tools(messages, tools, response_format)
    if thinking and drop_thinking:
        msgs = _drop_old_reasoning(msgs)
    last_user = last_user_index(msgs)
    parts = [BOS] if add_bos else []
    parts += [_render(i, msgs, last_user, thinking) for i in range(len(msgs))]
    return "".join(parts)


def _drop_old_reasoning(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    last_user = last_user_index(msgs)
    out = []
    for i, msg in enumerate(msgs):
        if msg.get("role") == "assistant" and i < last_user:
            msg = {k: v for k, v in msg.items() if k not in ("reasoning_content", "reasoning")}
        out.append(msg)
    return out


def _render(i: int, msgs: Sequence[Message], last_user: int, thinking: bool) -> str:
    msg = msgs[i]
    role = msg.get("role")
    opens = THINK_START if thinking and i == last_user else THINK_END
    if role == "system":
        return text_of(msg.get("content")) + message_extras(msg, tools_prompt)
    if role == "user":
        return USER + text_of(msg.get("content")) + ASSISTANT + opens
    if role == "developer":
        content = text_of(msg.get("content"))
        if not content:
            raise EncodeError("a developer message needs content")
        return (USER + message_extras(msg, tools_prompt) + "\n\n# The user's message is: " + content
                + ASSISTANT + opens)
    if role == "tool":
        return _render_tool(i, msgs, last_user, thinking)
    if role == "assistant":
        calls = calls_of(msg)
        reasoning = ""
        if thinking and i > last_user:
            if not reasoning_of(msg) and not calls:
                raise EncodeError("in thinking mode an assistant turn after the last user message needs "
                                  "reasoning_content or tool_calls")
            reasoning = reasoning_of(msg) + THINK_END
        return reasoning + text_of(msg.get("content")) + render_calls_block(calls, BLOCK) + EOS
    raise EncodeError(f"unknown role {role!r}")


def _render_tool(i: int, msgs: Sequence[Message], last_user: int, thinking: bool) -> str:
    """Tool results are matched to the previous assistant's calls by position, not by id."""
    prev = i - 1
    while prev >= 0 and msgs[prev].get("role") == "tool":
        prev -= 1
    if prev < 0 or msgs[prev].get("role") != "assistant":
        raise EncodeError(f"tool message {i} does not follow an assistant message")
    order, n_calls = i - prev, len(msgs[prev].get("tool_calls") or ())
    if order > n_calls:
        raise EncodeError(f"tool message {i}: {order} results for {n_calls} tool calls")
    text = "\n\n<function_results>" if order == 1 else ""
    text += f"\n<result>{text_of(msgs[i].get('content'))}</result>"
    if order == n_calls:
        text += "\n</function_results>\n\n" + (THINK_START if thinking and i >= last_user else THINK_END)
    return text
