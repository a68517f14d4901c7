"""DeepSeek-V4 prompt encoder (format of DeepSeek's reference `encoding_dsv4.py`).

Differences from V3.2 (docs/dsml.md, "DeepSeek-V4"): the block is `tool_calls`; there is no tool role —
tool results are merged into the next user turn as `<tool_result>` blocks, ordered by the
assistant's call order via `tool_call_id`; `<｜Assistant｜>` is written only where an assistant
turn follows; reasoning is kept for every turn when tools are present; `reasoning_effort="max"`
adds a fixed preamble in thinking mode.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.frontend.encoders.dsml_render import (ASSISTANT, BOS, DSML, EOS, THINK_END,
                                                   THINK_START, USER, EncodeError, Message, calls_of,
                                                   functions_of, last_user_index, message_extras,
                                                   reasoning_of, render_calls_block, text_of, to_json,
                                                   with_tools)

BLOCK = "tool_calls"
EFFORT_MAX_PREAMBLE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
# OpenAI effort names -> the two levels V4 knows (DeepSeek's API maps low/medium to high).
_EFFORTS = {None: None, "none": None, "minimal": "high", "low": "high", "medium": "high", "high": "high",
            "xhigh": "max", "max": "max"}


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    schemas = "\n".join(to_json(f) for f in functions_of(tools))
    return (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke tools by writing "
        f'a "<{DSML}tool_calls>" block like the following:\n\n'
        f"<{DSML}tool_calls>\n"
        f'<{DSML}invoke name="$TOOL_NAME">\n'
        f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
        "...\n"
        f"</{DSML}invoke>\n"
        f'<{DSML}invoke name="$TOOL_NAME2">\n'
        "...\n"
        f"</{DSML}invoke>\n"
        f"</{DSML}tool_calls>\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
        'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning "
        f"inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        f"{schemas}\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )


def encode_v4(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None, *,
              thinking: bool = False, reasoning_effort: str | None = None,
              response_format: Mapping[str, Any] | None = None, add_bos: bool = True,
              drop_thinking: bool = True) -> str:
    if reasoning_effort not in _EFFORTS:
        raise EncodeError(f"reasoning_effort must be one of {sorted(k for k in _EFFORTS if k)}, "
                          f"got {reasoning_effort!r}")
    effort = _EFFORTS[reasoning_effort]
    msgs = _order_results(_merge_tool_results(with_tools(messages, tools, response_format)))
    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        msgs = _drop_old_turns(msgs)
    last_user = last_user_index(msgs)
    parts = [BOS] if add_bos else []
    if thinking and effort == "max" and msgs:
        parts.append(EFFORT_MAX_PREAMBLE)
    parts += [_render(i, msgs, last_user, thinking, drop) for i in range(len(msgs))]
    return "".join(parts)


def _merge_tool_results(msgs: Sequence[Message]) -> list[dict[str, Any]]:
    """Tool messages become `tool_result` blocks of a user turn; a user message directly after
    them (or after another user message) joins the same turn."""
    out: list[dict[str, Any]] = []
    for msg in msgs:
        role = msg.get("role")
        merged_user = bool(out) and out[-1].get("role") == "user" and "blocks" in out[-1]
        if role == "tool":
            block = ("tool_result", str(msg.get("tool_call_id") or ""), _result_text(msg.get("content")))
            if merged_user:
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = ("text", "", text_of(msg.get("content")))
            if merged_user:
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block]})
        else:
            out.append(dict(msg))
    return out


def _result_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n\n".join(text_of([part]) for part in content)
    return text_of(content)


def _order_results(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Within a user turn, tool results follow the order of the preceding assistant's calls."""
    order: dict[str, int] = {}
    for msg in msgs:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {str(c.get("id")): n for n, c in enumerate(msg["tool_calls"]) if c.get("id")}
        elif msg.get("role") == "user" and order:
            blocks = msg["blocks"]
            results = sorted((b for b in blocks if b[0] == "tool_result"), key=lambda b: order.get(b[1], 0))
            if len(results) > 1:
                it = iter(results)
                msg["blocks"] = [next(it) if b[0] == "tool_result" else b for b in blocks]
    return msgs


def _drop_old_turns(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Before the last user turn: assistants lose their reasoning, developer messages go."""
    last_user = last_user_index(msgs)
    out = []
    for i, msg in enumerate(msgs):
        role = msg.get("role")
        if role in ("user", "system") or i >= last_user:
            out.append(msg)
        elif role == "assistant":
            out.append({k: v for k, v in msg.items() if k not in ("reasoning_content", "reasoning")})
    return out


def _render(i: int, msgs: Sequence[Message], last_user: int, thinking: bool, drop: bool) -> str:
    msg = msgs[i]
    role = msg.get("role")
    if role == "system":
        text = text_of(msg.get("content")) + message_extras(msg, tools_prompt)
    elif role == "developer":
        content = text_of(msg.get("content"))
        if not content:
            raise EncodeError("a developer message needs content")
        text = USER + content + message_extras(msg, tools_prompt)
    elif role == "user":
        text = USER + "\n\n".join(_block_text(b) for b in msg["blocks"])
    elif role == "assistant":
        reasoning = ""
        if thinking and (not drop or i > last_user):
            reasoning = reasoning_of(msg) + THINK_END
        text = reasoning + text_of(msg.get("content")) + render_calls_block(calls_of(msg), BLOCK) + EOS
    else:
        raise EncodeError(f"unknown role {role!r}")
    followed_by_reply = i + 1 == len(msgs) or msgs[i + 1].get("role") == "assistant"
    if followed_by_reply and role in ("user", "developer"):
        opens = thinking and (not drop or i >= last_user)
        text += ASSISTANT + (THINK_START if opens else THINK_END)
    return text


def _block_text(block: tuple[str, str, str]) -> str:
    kind, _, text = block
    return f"<tool_result>{text}</tool_result>" if kind == "tool_result" else text
