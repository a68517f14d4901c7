"""POST /v1/chat/completions: messages through the chat template, × n choices."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi.responses import Response

from pdserve.frontend.choice import ChoiceSpec
from pdserve.frontend.ids import room_ids
from pdserve.frontend.output import chat_decoder
from pdserve.frontend.params import expand_choices, resolve_max_tokens, sampling_params
from pdserve.frontend.protocol import ChatCompletionRequest
from pdserve.frontend.render import ChatRenderer
from pdserve.frontend.serving import Call, respond

if TYPE_CHECKING:
    from pdserve.frontend.server import Router


async def create_chat_completion(router: Router, req: ChatCompletionRequest, call: Call) -> Response:
    model = router.check_model(req.model)
    prompt = await router.prompts.chat(req)
    max_tokens = resolve_max_tokens(req.output_limit, len(prompt.ids), router.max_model_len, "messages")
    params = sampling_params(req, max_tokens, req.top_n, router.tokenizer.vocab_size)
    rooms = room_ids(call.room_base, req.n)
    specs = [ChoiceSpec(i, rooms[i], prompt.ids, p) for i, p in enumerate(expand_choices(params, req.n))]
    stop = req.stop_list()
    renderer = ChatRenderer(f"chatcmpl-{call.request_id}", model, len(specs), len(prompt.ids),
                            router.tokenizer, include_usage=req.include_usage, top_logprobs=req.top_n)
    return await respond(router, call, specs, lambda _: chat_decoder(router.tokenizer, stop, req),
                         renderer, req.stream)
