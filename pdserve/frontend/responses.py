"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat path.

A Responses request becomes a chat request (`chat_request`): `instructions` a system message,
`input` items messages (a run of the model's `function_call` items one assistant message with
those tool calls, a `function_call_output` a tool message), Responses-shaped function tools and
`text.format` their chat forms. From there it takes the chat path unchanged: the model's
template, the token-ID output parser, structured outputs, the workers.

`ResponsesRenderer` turns the choice's parser events into output items, in the order the model
wrote them: `reasoning`, `message` (one `output_text` part) and `function_call` items. Streaming
sends OpenAI's typed events (``event: <type>`` and ``data: <json>``, each with its
`sequence_number`): `response.created`, `response.in_progress`, then per item
`response.output_item.added`, its deltas and `….done` events, `response.output_item.done`, and
last `response.completed` (or `response.incomplete` when `max_output_tokens` cut the output,
`response.failed` when it failed). No `[DONE]` follows, as OpenAI sends none.

A call the model wrote that is not a valid call is never a `function_call` item a client would
run: one whose start was streamed ends with status "incomplete"; every such call is listed in
the response's `invalid_tool_calls`, as chat completions list them.

A stored response (`response_store.py`) can be continued: `previous_response_id` puts its
conversation before the request's own input (`history`), an `item_reference` input item stands
for a stored item (`resolve_references`), and a response that ended well is stored with its
conversation (`ResponsesRenderer.done`).
"""
from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from pdserve.frontend.errors import APIError, invalid
from pdserve.frontend.protocol import ChatCompletionRequest, ResponsesRequest
from pdserve.frontend.render import ItemRenderer, token_logprob
from pdserve.frontend.response_store import ResponseStore
from pdserve.parsers import ToolCallStart
from pdserve.tokenizer import Tokenizer
from pdserve.worker_api import TokenLogprob

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


# ---- request: Responses → chat -------------------------------------------------------------------


def history(store: ResponseStore, req: ResponsesRequest) -> tuple[dict[str, Any], ...]:
    """The conversation `req` continues: its previous response's (empty without one); 400 when
    that response is not stored here."""
    if req.previous_response_id is None:
        return ()
    if not store.enabled:
        raise invalid("This server stores no responses (--responses-store 0): send the whole conversation "
                      "in input instead of previous_response_id.", "previous_response_id")
    stored = store.get(req.previous_response_id)
    if stored is None:
        raise invalid(f"Previous response with id '{req.previous_response_id}' not found.", "previous_response_id",
                      "previous_response_not_found")
    return stored.conversation


def resolve_references(store: ResponseStore, req: ResponsesRequest,
                       before: tuple[dict[str, Any], ...]) -> ResponsesRequest:
    """`req` with each `item_reference` input item replaced by the stored item it names; 400 for
    an unknown id, and for an item the continued conversation holds already (as OpenAI's)."""
    if isinstance(req.input, str):
        return req
    earlier = {item["id"] for item in before if isinstance(item.get("id"), str)}
    items = []
    for i, item in enumerate(req.input):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            ref = item.get("id")
            if not isinstance(ref, str):
                raise invalid(f"input[{i}].id must be a string", f"input[{i}].id")
            if not store.enabled:
                raise invalid("This server stores no responses (--responses-store 0): send the item itself "
                              "instead of an item_reference.", f"input[{i}]")
            item = store.item(ref)
            if item is None:
                raise invalid(f"Item with id '{ref}' not found.", f"input[{i}].id")
        if isinstance(item, dict) and item.get("id") in earlier:
            raise invalid(f"Duplicate item found with id {item['id']}: the previous response's conversation "
                          "holds it already. Remove duplicate items from your input and try again.",
                          f"input[{i}]")
        items.append(item)
    return req.model_copy(update={"input": items})


def input_items(req: ResponsesRequest) -> list[Any]:
    """`input` as a list of items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input


def chat_request(req: ResponsesRequest, before: tuple[dict[str, Any], ...] = ()) -> ChatCompletionRequest:
    """The chat request that answers `req` after the conversation `before`; 400 (naming the
    Responses field) when an item, a tool or the format cannot be expressed."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for item in before:  # items this server stored: valid ones
        _add_item(messages, item, "previous_response_id")
    for i, item in enumerate(input_items(req)):
        _add_item(messages, item, f"input[{i}]")
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "seed": req.seed, "user": req.user, "parallel_tool_calls": req.parallel_tool_calls,
        "tools": [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools)] if req.tools else None,
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "response_format": _response_format(req.text),
        "reasoning_effort": (req.reasoning or {}).get("effort"),
        "cache_salt": req.cache_salt, "priority": req.priority,
        "logprobs": req.output_logprobs is not None, "top_logprobs": req.output_logprobs,
    }
    return ChatCompletionRequest.converted(body, {
        "messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
        "reasoning_effort": "reasoning.effort"})


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise invalid(f"{where}: an input item must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
        elif last is not None and last["role"] == "assistant" and last.get("content") is not None:
            last["tool_calls"] = [call]  # the text the model wrote before its calls
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": _text(item.get("output"), f"{where}.output")})
    elif kind == "reasoning":
        pass  # earlier reasoning: chat templates leave it out of later turns
    else:
        raise invalid(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                      "function_call_output and reasoning are)", f"{where}.type")


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"{where}[{j}]: only text parts are supported ({', '.join(TEXT_PARTS)}), got {kind!r}",
                          f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    """{"type": "function", "name", "description"?, "parameters"?, "strict"?} → the chat shape."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise invalid(f"{where}: only function tools are supported, got type {kind!r}", where)
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """The Responses shapes (`{"type": "function", "name"}`, `{"type": "allowed_tools", "mode",
    "tools": [{"type": "function", "name"}, …]}`) in chat's."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    tools = choice.get("tools")
    if choice.get("type") == "allowed_tools" and isinstance(tools, list) and all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str) for t in tools):
        named = [{"type": "function", "function": {"name": t["name"]}} for t in tools]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": named}}
    raise invalid('tool_choice must be "none", "auto", "required", {"type": "function", "name": …} or '
                  '{"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type": "function", '
                  '"name": …}, …]}', "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` → chat's `response_format` (a json_schema's name and schema move one level down)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("text.format must be an object", "text.format")
    if fmt.get("type") != "json_schema":
        return fmt
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


# ---- response: parser events → output items and stream events -----------------------------------


class ResponsesRenderer(ItemRenderer):
    """One choice's events → the Response object and its stream events (module docstring)."""

    object_name = "response"

    def __init__(self, response_id: str, model: str, prompt_tokens: int, tokenizer: Tokenizer,
                 req: ResponsesRequest, before: tuple[dict[str, Any], ...] = (),
                 store: ResponseStore | None = None) -> None:
        super().__init__(response_id, model, 1, prompt_tokens, tokenizer)
        self.created_at = time.time()
        self.req = req
        self.before = before  # the conversation it continues
        self.store = store    # where it is kept once it ended well (None: not kept)
        self.items: list[dict[str, Any]] = []  # output items, in the order they opened
        self.sequence = 0
        self.error: APIError | None = None
        self.logprobs = req.output_logprobs  # None: none; N: the text tokens' and N alternatives each
        self.held: list[TokenLogprob] = []   # tokens whose text has not come out (yet)

    # ---- the Renderer interface --------------------------------------------------------------

    def opening(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def closing(self) -> list[dict[str, Any]]:
        name = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [self._event(name, response=self.response())]

    def failure(self, error: APIError) -> str:
        self.error = error
        out = self._close(final=True)
        return "".join(self.sse(e) for e in out) + self.sse(self._event("response.failed", response=self.response()))

    def done(self) -> None:
        """Kept with its conversation: what came before, its input, its output (less the calls
        that are not valid calls: nobody ran them, nobody answers them)."""
        if self.store is None:
            return
        output = [item for item in self.items if item["type"] != "function_call" or item["status"] == "completed"]
        inputs = [_with_id(item) for item in input_items(self.req)]
        self.store.put(self.response(), self.before, inputs, copy.deepcopy(output))

    def response(self) -> dict[str, Any]:
        req, state = self.req, self.choices[0]
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": self.status, "output": copy.deepcopy(self.items),
            "error": None if self.error is None else {"code": self.error.code or self.error.type,
                                                      "message": self.error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": req.text or {"format": {"type": "text"}}, "truncation": req.truncation or "disabled",
            "top_logprobs": req.top_logprobs,
            "store": self.store is not None, "previous_response_id": req.previous_response_id,
            "metadata": req.metadata or {}, "user": req.user,
            "usage": None if self.status == "in_progress" else {
                "input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": state.cached_tokens},
                # reasoning is not counted apart from the rest of the output
                "output_tokens": state.num_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + state.num_tokens},
        }
        if state.invalid:
            out["invalid_tool_calls"] = state.invalid
        return out

    @property
    def status(self) -> str:
        reason = self.choices[0].finish_reason
        if self.error is not None:
            return "failed"
        if reason is None:
            return "in_progress"
        return "incomplete" if reason == "length" else "completed"

    # ---- items (ItemRenderer's hooks) ---------------------------------------------------------

    def _token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        """With logprobs, a message's text tokens are the tokens whose text it took: a token
        waits until text comes out (a character split over tokens, white space the parser holds
        until it knows what follows) and goes with that text; tokens that wrote reasoning or a
        call, and markers (special tokens), are not the message's."""
        if self.logprobs is not None and logprob is not None and not self.tokenizer.is_special(token_id):
            self.held.append(logprob)

    def _opened(self, index: int, kind: str) -> list[dict[str, Any]]:
        if kind == "text":
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items.append({"type": "message", "id": _item_id("msg"), "status": "in_progress",
                               "role": "assistant", "content": [part]})
        else:
            part = {"type": "reasoning_text", "text": ""}
            self.items.append({"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": [part],
                               "status": "in_progress"})
        return [self._added(index), self._event("response.content_part.added", item_id=self.items[index]["id"],
                                                output_index=index, content_index=0, part=dict(part))]

    def _text(self, index: int, text: str) -> list[dict[str, Any]]:
        item = self.items[index]
        item["content"][0]["text"] += text
        taken, self.held = self.held, []
        if item["type"] == "message":
            logprobs = [token_logprob(self.tokenizer, lp, self.logprobs or 0) for lp in taken]
            item["content"][0]["logprobs"] += logprobs
            return [self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                content_index=0, delta=text, logprobs=[_event_logprob(e) for e in logprobs])]
        return [self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                            content_index=0, delta=text)]

    def _call_opened(self, index: int, call: ToolCallStart) -> list[dict[str, Any]]:
        self.held = []
        self.items.append({"type": "function_call", "id": _item_id("fc"), "call_id": call.id, "name": call.name,
                           "arguments": "", "status": "in_progress"})
        return [self._added(index)]

    def _call_args(self, index: int, fragment: str) -> list[dict[str, Any]]:
        item = self.items[index]
        self.held = []
        item["arguments"] += fragment
        return [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=fragment)]

    def _call_ended(self, index: int, complete: bool) -> None:
        if not complete:
            self.items[index]["status"] = "incomplete"

    def _call_invalid(self, index: int) -> None:
        self.items[index]["status"] = "incomplete"

    def _closed(self, index: int, final: bool) -> list[dict[str, Any]]:
        """The item's done events. Another item follows it (completed), or the output ended
        (`final`): cut by the token limit or a failure (incomplete) or not."""
        item = self.items[index]
        if item["status"] == "in_progress":
            cut = final and self.status in ("incomplete", "failed")
            item["status"] = "incomplete" if cut else "completed"
        out = []
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            name = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": [_event_logprob(e) for e in part["logprobs"]]} if item["type"] == "message" else {}
            out += [self._event(name, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                                **extra),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=dict(part))]
        return out + [self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _added(self, index: int) -> dict[str, Any]:
        item = dict(self.items[index])
        if "content" in item:
            item["content"] = []  # its part comes in content_part.added
        return self._event("response.output_item.added", output_index=index, item=item)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}


def _event_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    """A logprob as the text delta and done events give it: the output part's, without bytes."""
    return {"token": entry["token"], "logprob": entry["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]]}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _with_id(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as it is stored and listed: with its type and an id (OpenAI lists and
    references input items by id too), a message's text as a list of parts."""
    kind = item.get("type", "message")
    if isinstance(item.get("id"), str) and "type" in item and not isinstance(item.get("content"), str):
        return item  # as given (or an item this server stored before)
    ident = item.get("id") if isinstance(item.get("id"), str) else _item_id(ITEM_ID_PREFIXES.get(kind, "item"))
    stored = {"type": kind, "id": ident, **{k: v for k, v in item.items() if k not in ("type", "id")}}
    if kind == "message" and isinstance(item.get("content"), str):
        part = ({"type": "output_text", "text": item["content"], "annotations": []} if item.get("role") == "assistant"
                else {"type": "input_text", "text": item["content"]})
        stored["content"] = [part]
    return stored
