"""POST /v1/chat/completions: messages through the model's prompt format, × n choices.

The request's tool policy (``tools``) decides what the prompt shows and how each choice's
output parser treats calls; every choice gets its own decoder (``output``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi.responses import Response

from pdserve.frontend.choice import ChoiceSpec
from pdserve.frontend.ids import room_ids
from pdserve.frontend.params import expand_choices, resolve_max_tokens, sampling_params
from pdserve.frontend.protocol import ChatCompletionRequest
from pdserve.frontend.render import ChatRenderer
from pdserve.frontend.serving import Call, respond
from pdserve.frontend.tools import ToolPolicy

if TYPE_CHECKING:
    from pdserve.frontend.server import Router


async def create_chat_completion(router: Router, req: ChatCompletionRequest, call: Call) -> Response:
    model = router.check_model(req.model)
    policy = ToolPolicy.of(req)
    prompt = await router.prompts.chat(req, policy.prompt_tools, router.output.prompt_style)
    max_tokens = resolve_max_tokens(req.output_limit, len(prompt.ids), router.max_model_len, "messages")
    params = sampling_params(req, max_tokens, req.top_n, router.tokenizer.vocab_size)
    rooms = room_ids(call.room_base, req.n)
    specs = [ChoiceSpec(i, rooms[i], prompt.ids, p) for i, p in enumerate(expand_choices(params, req.n))]
    stop, stop_ids = req.stop_list(), req.stop_token_ids or []
    renderer = ChatRenderer(f"chatcmpl-{call.request_id}", model, len(specs), len(prompt.ids),
                            router.tokenizer, include_usage=req.include_usage, top_logprobs=req.top_n)
    return await respond(router, call, specs,
                         lambda spec: router.output.decoder(spec.prompt_ids, stop, policy, stop_ids),
                         renderer, req.stream)
