"""Prompts → token ids: completions' text or ids, chat messages through the chat template.

Workers see token ids only. Long texts are tokenized in a thread so that one big prompt does not
stall every stream on the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2

from pdserve.frontend.errors import invalid
from pdserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Prompt:
    ids: list[int]
    text: str  # what `echo` prints: the prompt text, or the decoded ids


@dataclass
class PromptBuilder:
    tokenizer: Tokenizer
    inline_chars: int = 4096

    async def completion(self, req: CompletionRequest) -> list[Prompt]:
        items: list[Any] = _prompt_list(req.prompt)
        size = sum(len(p) for p in items if isinstance(p, str))
        return await self._run(size, lambda: [self._one(p) for p in items])

    async def chat(self, req: ChatCompletionRequest) -> Prompt:
        size = sum(len(m.text()) for m in req.messages)
        return await self._run(size, lambda: self._render(req))

    async def _run(self, size: int, work: Callable[[], T]) -> T:
        if size <= self.inline_chars:
            return work()
        return await asyncio.to_thread(work)

    def _one(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            return Prompt(self.tokenizer.encode(prompt, add_special_tokens=True), prompt)
        self.check_ids(prompt, "prompt")
        return Prompt(list(prompt), self.tokenizer.decode(prompt))

    def _render(self, req: ChatCompletionRequest) -> Prompt:
        messages = [_message_dict(m) for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise invalid(f"the chat template rejected the messages: {e}", "messages") from None
        if req.continue_final_message:
            text = _cut_after_last(text, messages[-1]["content"])
        return Prompt(self.tokenizer.encode(text, add_special_tokens=False), text)

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"token id {bad} is outside the vocabulary [0, {vocab})", param)


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """One prompt per item: a string, a list of strings, one id list, or a list of id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def _message_dict(message: Any) -> dict[str, Any]:
    out = message.model_dump(exclude_none=True)
    out["content"] = message.text()
    return out


def _cut_after_last(text: str, content: str) -> str:
    """continue_final_message: end the rendered prompt right after the final message's text."""
    at = text.rfind(content) if content else -1
    return text[:at + len(content)] if at >= 0 else text
