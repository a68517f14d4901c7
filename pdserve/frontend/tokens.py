"""POST /tokenize and /detokenize, GET /version: what vLLM users reach for beside the OpenAI API;
POST /v1/messages/count_tokens, Anthropic's.

/tokenize and count_tokens render messages through the same path as /v1/chat/completions
(template, tools, the model's prompt style), so their ids are the ones a chat request would send
to the workers.
"""
from __future__ import annotations

import asyncio
from typing import Any

from pydantic import ValidationError

from pdserve.frontend.errors import invalid, validation_message
from pdserve.frontend.prompts import Prompt
from pdserve.frontend.messages import chat_request as messages_chat_request
from pdserve.frontend.protocol import (ChatCompletionRequest, CountTokensRequest, DetokenizeRequest, MessagesRequest,
                                       TokenizeRequest)
from pdserve.frontend.render import token_text
from pdserve.frontend.requests import Serving
from pdserve.frontend.tools import ToolPolicy


async def tokenize(s: Serving, req: TokenizeRequest) -> dict[str, Any]:
    s.check_model(req.model)
    if req.prompt is not None:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await asyncio.to_thread(s.tokenizer.encode, req.prompt, add)  # the GIL is released
        prompt = Prompt(ids, req.prompt)
    else:
        try:
            chat = ChatCompletionRequest.model_validate({
                "messages": req.messages, "tools": req.tools, "add_generation_prompt": req.add_generation_prompt,
                "continue_final_message": req.continue_final_message,
                "chat_template_kwargs": req.chat_template_kwargs, "reasoning_effort": req.reasoning_effort})
        except ValidationError as e:
            raise invalid(*validation_message(e.errors(include_url=False))) from None
        prompt = await s.prompts.chat(chat, ToolPolicy.of(chat).prompt_tools, s.output.prompt_style)
    out: dict[str, Any] = {"count": len(prompt.ids), "max_model_len": s.max_model_len, "tokens": prompt.ids}
    if req.return_token_strs:
        out["token_strs"] = [token_text(s.tokenizer, t) for t in prompt.ids]
    return out


async def count_tokens(s: Serving, req: CountTokensRequest) -> dict[str, Any]:
    """The prompt tokens a Messages request with these messages, system and tools would have."""
    s.check_model(req.model)
    body = {**req.model_dump(exclude_none=True), "max_tokens": 1}  # generation settings do not count
    chat = messages_chat_request(MessagesRequest.model_validate(body))
    prompt = await s.prompts.chat(chat, ToolPolicy.of(chat).prompt_tools, s.output.prompt_style)
    return {"input_tokens": len(prompt.ids)}


def detokenize(s: Serving, req: DetokenizeRequest) -> dict[str, Any]:
    s.check_model(req.model)
    s.prompts.check_ids(req.tokens, "tokens")
    return {"prompt": s.tokenizer.decode(req.tokens)}
