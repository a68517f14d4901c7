"""Prompts → token ids: completions' text or ids, chat messages through the model's prompt format.

Chat prompts: DeepSeek V3.2 and V4 ship Python encoders instead of Jinja templates, so their
messages (tools in the system prompt, assistant tool calls rendered back, tool results,
`thinking` from ``chat_template_kwargs``) go through ``encoders``; every other model through its
own chat template, with the request's tools. DeepSeek V3/R1 and V3.1 templates need the OpenAI
shapes as they are (`arguments` a JSON string, `content: null` beside tool calls) and do not
render `tools` at all: their tools go into the system prompt here, in the format DeepSeek
documents for V3.1 (``dsv3_tools_prompt``). Workers see token ids only. Long texts are
tokenized in a thread so that one big prompt does not stall every stream on the event loop, and
a prompt (chat, or a completion's text) tokenizes only what follows the longest prefix an
earlier prompt left (``prompt_prefixes``): a conversation's next turn pays for its new text only.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

import jinja2

from pdserve.frontend.encoders import EncodeError, encode_v4, encode_v32, thinking_from_kwargs
from pdserve.frontend.errors import context_too_long, invalid
from pdserve.frontend.prompt_prefixes import PromptPrefixes
from pdserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")


class PromptStyle(Enum):
    TEMPLATE = "template"  # the tokenizer's Jinja chat template
    DSV3 = "deepseek_v3"   # the Jinja template, DeepSeek V3/R1 shapes (see the module docstring)
    DSV31 = "deepseek_v31"  # the same for V3.1 (its own call format in the tools section)
    DSV32 = "deepseek_v32"
    DSV4 = "deepseek_v4"

    @classmethod
    def for_profile(cls, profile_name: str) -> PromptStyle:
        """DeepSeek V3.2/V4 profiles are encoded by the reference encoders, whatever else ships."""
        return {"deepseek_v3": cls.DSV3, "deepseek_v31": cls.DSV31, "deepseek_v32": cls.DSV32,
                "deepseek_v4": cls.DSV4}.get(profile_name, cls.TEMPLATE)


@dataclass
class Prompt:
    ids: list[int]
    text: str  # what `echo` prints: the prompt text, or the decoded ids


@dataclass
class PromptBuilder:
    tokenizer: Tokenizer
    inline_chars: int = 4096
    prefixes: PromptPrefixes = field(init=False)  # a conversation's earlier turns' ids

    def __post_init__(self) -> None:
        self.prefixes = PromptPrefixes(self.tokenizer)

    async def completion(self, req: CompletionRequest, max_len: int | None = None) -> list[Prompt]:
        """`max_len`: a text that cannot fit it, by its size alone, is refused untokenized."""
        items: list[Any] = _prompt_list(req.prompt)
        for p in items:
            if isinstance(p, str):
                self._check_size(p, max_len, "prompt")
        size = sum(len(p) for p in items if isinstance(p, str))
        return await self._run(size, lambda: [self._one(p, req.cache_salt) for p in items])

    async def chat(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None,
                   style: PromptStyle = PromptStyle.TEMPLATE, max_len: int | None = None) -> Prompt:
        """`tools`: what the prompt shows (none when tool_choice is "none"; see ``tools``).
        `max_len`: messages that cannot fit it, by their size alone, are refused untokenized."""
        # assistant turns are left out of the bound: some templates drop parts of them (thinking)
        self._check_size("".join(m.text() for m in req.messages if m.role != "assistant"), max_len,
                         "messages")
        size = sum(len(m.text()) for m in req.messages) + (len(json.dumps(tools)) if tools else 0)
        return await self._run(size, lambda: self._render(req, tools, style))

    async def chat_within(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                          style: PromptStyle, max_len: int, room: int) -> tuple[ChatCompletionRequest, Prompt]:
        """The request with as few of its earliest turns dropped as lets its prompt leave `room`
        tokens of `max_len` (the Responses API's `truncation: "auto"`), and that prompt. A turn
        runs from a user message to the next one, so a call and its result go together; the
        system messages before the first turn stay. 400 when the last turn alone does not fit."""
        messages = list(req.messages)
        head = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
        # where each turn starts (what precedes the first user message belongs to its turn)
        turns = [head] + [i for i in range(head + 1, len(messages)) if messages[i].role == "user"]

        def without(k: int) -> ChatCompletionRequest:  # the first k turns dropped
            return req.model_copy(update={"messages": messages[:head] + messages[turns[k]:]})

        def search() -> tuple[int, Prompt]:
            lo, hi, best = 0, len(turns) - 1, None  # the fewest turns dropped that fit
            while lo <= hi:
                k = (lo + hi) // 2
                prompt = self._render(without(k), tools, style)
                if len(prompt.ids) + room <= max_len:
                    best, hi = (k, prompt), k - 1
                else:
                    lo = k + 1
            if best is None:
                prompt = self._render(without(len(turns) - 1), tools, style)
                raise context_too_long(max_len, len(prompt.ids), room, "messages")
            return best

        size = sum(len(m.text()) for m in messages) + (len(json.dumps(tools)) if tools else 0)
        dropped, prompt = await self._run(size, search)
        if dropped:
            logger.info("truncation: the first %d of %d turns dropped to fit %d tokens", dropped, len(turns), max_len)
        return without(dropped), prompt

    def _check_size(self, text: str, max_len: int | None, param: str) -> None:
        """400 without tokenizing when the text's bytes prove it has at least max_len tokens (a
        6 MB body would otherwise cost seconds of tokenizer time for a certain refusal)."""
        if max_len is None or len(text) < max_len:  # no text of fewer characters can be that long
            return
        least = self.tokenizer.min_tokens(text)
        if least >= max_len:
            raise context_too_long(max_len, least, None, param, at_least=True)

    async def _run(self, size: int, work: Callable[[], T]) -> T:
        if size <= self.inline_chars:
            return work()
        return await asyncio.to_thread(work)

    def _one(self, prompt: str | list[int] | None, salt: str | None) -> Prompt:
        if prompt is None:  # a new document: the model's start-of-text token, as OpenAI's default
            start = self.tokenizer.bos_token_id
            start = self.tokenizer.eos_token_id if start is None else start
            if start is None:
                raise invalid("this model has no start-of-text token: give a prompt", "prompt")
            return Prompt([start], "")
        if isinstance(prompt, str):  # an agent's own template resent with a new turn: its ids reused
            ids = self.prefixes.encode(prompt, salt, add_special_tokens=True)
            if not ids:
                raise invalid("prompt must not be empty", "prompt")
            return Prompt(ids, prompt)
        self.check_ids(prompt, "prompt")
        return Prompt(list(prompt), self.tokenizer.decode(prompt))

    def _render(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                style: PromptStyle) -> Prompt:
        dsv3 = style in (PromptStyle.DSV3, PromptStyle.DSV31)
        messages = [_message_dict(m, keep_null=dsv3) for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        if dsv3:
            text = self._dsv3_template(req, messages, tools, kwargs, fenced=style is PromptStyle.DSV3)
        elif style is PromptStyle.TEMPLATE:
            text = self._template(req, messages, tools, kwargs)
        else:
            text = self._encode(req, messages, tools, kwargs, style)
        return Prompt(self.prefixes.encode(text, req.cache_salt), text)

    def _dsv3_template(self, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], fenced: bool) -> str:
        """DeepSeek V3/R1/V3.1 templates concatenate `arguments` as a string: it stays one (it
        must still be a JSON object). Unless the template renders `tools` itself, they go into
        the system prompt."""
        for m in messages:
            for call in m.get("tool_calls") or []:
                _arguments_as_object(call)  # the same 400 as for other templates
        template = self.tokenizer.chat_templates.get("default", "")
        if tools and not re.search(r"\btools\b", template):
            messages = with_system_text(messages, dsv3_tools_prompt(tools, fenced))
            tools = None
        return self._render_template(req, messages, tools, kwargs)

    def _template(self, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> str:
        for m in messages:  # templates read arguments as a mapping (GLM: `arguments.items()`)
            if m.get("tool_calls"):
                m["tool_calls"] = [_arguments_as_object(c) for c in m["tool_calls"]]
        return self._render_template(req, messages, tools, kwargs)

    def _render_template(self, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=req.add_generation_prompt, **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise invalid(f"the chat template rejected the messages: {e}", "messages") from None
        if req.continue_final_message:
            text = _cut_after_last(text, messages[-1]["content"])
        return text

    def _encode(self, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], style: PromptStyle) -> str:
        """The DeepSeek encoders; they always end with the assistant's turn opened."""
        if req.continue_final_message:
            raise invalid("continue_final_message is not supported for DeepSeek V3.2/V4 prompts",
                          "continue_final_message")
        thinking = thinking_from_kwargs(kwargs)
        drop = bool(kwargs.get("drop_thinking", True))
        try:
            if style is PromptStyle.DSV4:
                return encode_v4(messages, tools, thinking=thinking, drop_thinking=drop,
                                 reasoning_effort=kwargs.get("reasoning_effort"))
            return encode_v32(messages, tools, thinking=thinking, drop_thinking=drop)
        except EncodeError as e:
            raise invalid(f"the messages cannot be encoded for this model: {e}", "messages") from None

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"token id {bad} is outside the vocabulary [0, {vocab})", param)


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]] | None) -> list[Any]:
    """One prompt per item: a string, a list of strings, one id list, or a list of id lists."""
    if prompt is None:
        return [None]
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def _message_dict(message: Any, keep_null: bool = False) -> dict[str, Any]:
    """`keep_null`: `content: null` stays None (DeepSeek V3 templates test `content is none`
    beside tool calls); other templates get "" for it."""
    out = message.model_dump(exclude_none=True)
    out["content"] = None if keep_null and message.content is None else message.text()
    if out["role"] == "function":  # the deprecated function result: a tool result to templates
        out["role"] = "tool"
    return out


# DeepSeek V3/R1 and V3.1: how a call is written, told to the model in the tools section.
_DSV3_CALL = {
    False: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>"
           "<｜tool▁calls▁end｜>",
    True: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGUMENTS\n```"
          "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
}


def dsv3_tools_prompt(tools: list[dict[str, Any]], fenced: bool) -> str:
    """The tools section of a DeepSeek V3/R1 (`fenced`) or V3.1 system prompt: each tool's
    name, description and JSON parameter schema, then the call format the parser reads."""
    lines = ["## Tools", "You have access to the following tools:"]
    for tool in tools:
        fn = tool.get("function", tool)
        lines += ["", f"### {fn.get('name', '')}", f"Description: {fn.get('description') or ''}", "",
                  f"Parameters: {json.dumps(fn.get('parameters') or {}, ensure_ascii=False)}"]
    several = "one call after another, with nothing between them" if not fenced \
        else "one call after another, separated by a newline"
    lines += ["", "IMPORTANT: to use tools, ALWAYS write exactly this format:", _DSV3_CALL[fenced], "",
              "Where:", "- NAME is exactly the name of one of the tools above",
              "- ARGUMENTS is a JSON object that follows that tool's Parameters schema",
              f"- several calls go inside one block, {several}"]
    return "\n".join(lines)


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` appended to the first system message (after a blank line), or a system message of
    its own in front."""
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        content = first.get("content") or ""
        return [{**first, "content": f"{content}\n\n{text}" if content else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _arguments_as_object(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call whose `function.arguments` JSON string is parsed into an object."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    text = fn["arguments"]
    try:
        arguments = json.loads(text) if text.strip() else {}
    except ValueError:
        raise invalid(f"tool call arguments must be a JSON object, got {text[:80]!r}", "messages") from None
    if not isinstance(arguments, dict):
        raise invalid(f"tool call arguments must be a JSON object, got {text[:80]!r}", "messages")
    return {**call, "function": {**fn, "arguments": arguments}}


def _cut_after_last(text: str, content: str) -> str:
    """continue_final_message: end the rendered prompt right after the final message's text."""
    at = text.rfind(content) if content else -1
    return text[:at + len(content)] if at >= 0 else text
