"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on top of
the chat path, for agents built on Anthropic's clients (Claude Code and the `anthropic` SDK).

A Messages request becomes a chat request (`chat_request`): `system` a system message; a user
message's `tool_result` blocks tool messages (in order, before the rest of its text); an
assistant message's `tool_use` blocks its tool calls (`input` as JSON arguments); `tools`
(`input_schema`) function tools; `tool_choice` `auto`/`any`/`tool`/`none` the chat choices
(`disable_parallel_tool_use` turns parallel calls off); `stop_sequences` stop strings;
`output_config.format` (a JSON schema) the structured output. Earlier
`thinking` blocks are left out, as chat templates leave past reasoning out. `thinking` turns the
template's reasoning switch on or off (`chat_template_kwargs` `thinking` and `enable_thinking`),
and `output_config.effort` is chat's `reasoning_effort`. A final assistant
message of text is a prefill, as Anthropic's: the model continues it (chat's
`continue_final_message`), and the answer holds only what follows. From there it takes the chat
path unchanged: the model's template, the token-ID parser, the workers.

`MessagesRenderer` turns the choice's parser events into content blocks in the order the model
wrote them: `thinking`, `text` and `tool_use` (its `input` the parsed arguments). Streaming sends
Anthropic's events (``event: <type>`` and ``data: <json>``): `message_start`, per block
`content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`) and
`content_block_stop`, then `message_delta` (stop reason, output tokens) and `message_stop`; a
failure mid-stream ends it with an `error` event. Errors are Anthropic's error objects
(``errors.anthropic_body``).

`usage` counts as Anthropic's does: `input_tokens` are the prompt tokens not read from the
prefix cache, `cache_read_input_tokens` those that were.
"""
from __future__ import annotations

import json
from typing import Any

from pdserve.frontend.errors import APIError, anthropic_body, invalid
from pdserve.frontend.protocol import ChatCompletionRequest, MessagesRequest
from pdserve.frontend.render import ItemRenderer
from pdserve.parsers import ToolCallStart
from pdserve.tokenizer import Tokenizer

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# ---- request: Messages → chat --------------------------------------------------------------------


def chat_request(req: MessagesRequest, stream: bool | None = None) -> ChatCompletionRequest:
    """The chat request that answers `req`; 400 (naming the Messages field) when a block, a
    tool or the tool choice cannot be expressed."""
    if req.mcp_servers:  # as server tools: the model would be told of tools nobody runs
        raise invalid("MCP servers are not supported: connect them in the client and send their tools as "
                      "client tools", "mcp_servers")
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, message in enumerate(req.messages):
        _add_message(messages, message, f"messages[{i}]")
    choice = req.tool_choice or {}
    last = messages[-1] if len(req.messages) else None
    prefill = (last is not None and last["role"] == "assistant" and "tool_calls" not in last
               and isinstance(last["content"], str))
    if prefill and last["content"] != last["content"].rstrip():
        # as Anthropic: the model would continue after a space it would rather have written
        raise invalid("final assistant content cannot end with trailing whitespace",
                      f"messages[{len(req.messages) - 1}].content")
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_tokens,
        "stream": req.stream if stream is None else stream,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences,
        "tools": [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools)] if req.tools else None,
        "tool_choice": _chat_tool_choice(choice) if req.tools or choice else None,
        "parallel_tool_calls": False if choice.get("disable_parallel_tool_use") else None,
        "response_format": _response_format(req.output_config),
        "continue_final_message": prefill or None, "add_generation_prompt": not prefill,
        "chat_template_kwargs": _thinking(req.thinking),
        "reasoning_effort": (req.output_config or {}).get("effort"),
        "cache_salt": req.cache_salt, "priority": req.priority,
    }
    return ChatCompletionRequest.converted(body, {"stop": "stop_sequences", "reasoning_effort": "output_config.effort"})


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """`thinking` as the templates' switch: DeepSeek's `thinking`, Qwen's `enable_thinking`
    (None: the template's default)."""
    kind = (thinking or {}).get("type")
    if kind is None:
        return None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise invalid(f"thinking.type must be 'enabled', 'adaptive' or 'disabled', got {kind!r}", "thinking.type")
    on = kind != "disabled"
    return {"thinking": on, "enable_thinking": on}


def _add_message(messages: list[dict[str, Any]], message: dict[str, Any], where: str) -> None:
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise invalid(f"{where}.role must be 'user' or 'assistant', got {role!r}", f"{where}.role")
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            messages.append({"role": "tool", "tool_call_id": _field(block, "tool_use_id", str, at),
                             "content": result if isinstance(result, str) else _text(result, f"{at}.content")})
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": _field(block, "id", str, at), "type": "function", "function": {
                "name": _field(block, "name", str, at), "arguments": json.dumps(_field(block, "input", dict, at))}})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning: chat templates leave it out of later turns
        else:
            supported = "text and tool_result" if role == "user" else "text, tool_use and thinking"
            raise invalid(f"{at}: {role} content blocks of type {kind!r} are not supported ({supported} are)",
                          f"{at}.type")
    if role == "assistant" and (texts or calls):
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        messages.append(turn | {"tool_calls": calls} if calls else turn)
    elif texts:
        messages.append({"role": "user", "content": "".join(texts)})


def _text(blocks: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list) or not all(isinstance(b, dict) and b.get("type") == "text"
                                               and isinstance(b.get("text"), str) for b in blocks):
        raise invalid(f"{where} must be a string or a list of text blocks", where)
    return "".join(b["text"] for b in blocks)


def _field(block: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = block.get(key)
    if not isinstance(value, kind):
        raise invalid(f"{where}.{key} must be {'a string' if kind is str else 'an object'}", f"{where}.{key}")
    return value


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    """{"name", "description"?, "input_schema"} (a client tool) → the chat function tool."""
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise invalid(f"{where}: only client tools (name, description, input_schema) are supported, "
                      f"got type {kind!r}", where)
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    function |= {k: tool[k] for k in ("description", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """`output_config.format` (a JSON schema the answer follows) → chat's `response_format`."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise invalid('output_config.format must be {"type": "json_schema", "schema": {…}}', "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def _chat_tool_choice(choice: dict[str, Any]) -> str | dict[str, Any]:
    kind = choice.get("type", "auto")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid('tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": …}',
                  "tool_choice")


# ---- response: parser events → content blocks and stream events ----------------------------------


class MessagesRenderer(ItemRenderer):
    """One choice's events → the Message object and its stream events (module docstring)."""

    object_name = "message"

    def __init__(self, message_id: str, model: str, prompt_tokens: int, tokenizer: Tokenizer) -> None:
        super().__init__(message_id, model, 1, prompt_tokens, tokenizer)
        self.blocks: list[dict[str, Any]] = []   # content blocks, in the order they opened
        self.arguments: dict[int, str] = {}      # a tool_use block's arguments as the model wrote them
        self.dropped: set[int] = set()           # blocks of calls that are not valid calls

    # ---- the Renderer interface --------------------------------------------------------------

    def opening(self) -> list[dict[str, Any]]:
        message = {**self.response(), "content": [], "stop_reason": None, "stop_sequence": None}
        message["usage"] = {**message["usage"], "output_tokens": 0}
        return [{"type": "message_start", "message": message}]

    def closing(self) -> list[dict[str, Any]]:
        """The stop reason and the usage: all of it, since the prompt's cached part is known only
        now (message_start counted the whole prompt as input)."""
        message = self.response()
        return [{"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                    "stop_sequence": message["stop_sequence"]},
                 "usage": message["usage"]},
                {"type": "message_stop"}]

    def failure(self, error: APIError) -> str:
        return self.sse(anthropic_body(error))

    def response(self) -> dict[str, Any]:
        state = self.choices[0]
        reason = STOP_REASONS.get(state.finish_reason) if state.finish_reason else None
        if reason == "end_turn" and state.stop_sequence is not None:
            reason = "stop_sequence"
        out: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [b for i, b in enumerate(self.blocks) if i not in self.dropped],
            "stop_reason": reason, "stop_sequence": state.stop_sequence if reason == "stop_sequence" else None,
            "usage": {"input_tokens": self.prompt_tokens - state.cached_tokens, "output_tokens": state.num_tokens,
                      "cache_read_input_tokens": state.cached_tokens, "cache_creation_input_tokens": 0},
        }
        if state.invalid:
            out["invalid_tool_calls"] = state.invalid
        return out

    # ---- blocks (ItemRenderer's hooks) --------------------------------------------------------

    def _opened(self, index: int, kind: str) -> list[dict[str, Any]]:
        self.blocks.append({"type": "text", "text": ""} if kind == "text"
                           else {"type": "thinking", "thinking": "", "signature": ""})
        return [{"type": "content_block_start", "index": index, "content_block": dict(self.blocks[index])}]

    def _text(self, index: int, text: str) -> list[dict[str, Any]]:
        key = self.blocks[index]["type"]  # "text" or "thinking": the block's field and its delta's name
        self.blocks[index][key] += text
        return [{"type": "content_block_delta", "index": index, "delta": {"type": f"{key}_delta", key: text}}]

    def _call_opened(self, index: int, call: ToolCallStart) -> list[dict[str, Any]]:
        self.arguments[index] = ""
        self.blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        return [{"type": "content_block_start", "index": index, "content_block": dict(self.blocks[index])}]

    def _call_args(self, index: int, fragment: str) -> list[dict[str, Any]]:
        self.arguments[index] += fragment
        return [{"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": fragment}}]

    def _call_ended(self, index: int, complete: bool) -> None:
        try:
            self.blocks[index]["input"] = json.loads(self.arguments[index] or "{}")
        except ValueError:
            self.dropped.add(index)
        if not complete:
            self.dropped.add(index)  # cut inside the call: not a call to run

    def _call_invalid(self, index: int) -> None:
        self.dropped.add(index)

    def _closed(self, index: int, final: bool) -> list[dict[str, Any]]:
        return [{"type": "content_block_stop", "index": index}]
