"""POST /v1/completions: prompts (text or ids, one or many) × n choices."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi.responses import Response

from pdserve.frontend.choice import ChoiceSpec
from pdserve.frontend.errors import invalid
from pdserve.frontend.ids import room_ids
from pdserve.frontend.output import completion_decoder
from pdserve.frontend.params import expand_choices, resolve_max_tokens, sampling_params
from pdserve.frontend.protocol import CompletionRequest
from pdserve.frontend.render import CompletionRenderer
from pdserve.frontend.serving import Call, respond

if TYPE_CHECKING:
    from pdserve.frontend.server import Router


async def create_completion(router: Router, req: CompletionRequest, call: Call) -> Response:
    model = router.check_model(req.model)
    if req.echo and req.logprobs is not None:
        raise invalid("echo together with logprobs is not supported (prompt logprobs are not computed)",
                      "echo")
    prompts = await router.prompts.completion(req)
    max_len = router.max_model_len
    rooms = room_ids(call.room_base, len(prompts) * req.n)
    specs: list[ChoiceSpec] = []
    echo: list[str] = []
    for p, prompt in enumerate(prompts):
        max_tokens = resolve_max_tokens(req.max_tokens, len(prompt.ids), max_len, "prompt")
        params = sampling_params(req, max_tokens, req.logprobs, router.tokenizer.vocab_size)
        for k, choice_params in enumerate(expand_choices(params, req.n)):
            index = p * req.n + k
            specs.append(ChoiceSpec(index, rooms[index], prompt.ids, choice_params))
            echo.append(prompt.text)
    stop = req.stop_list()
    renderer = CompletionRenderer(
        f"cmpl-{call.request_id}", model, len(specs), sum(len(p.ids) for p in prompts), router.tokenizer,
        include_usage=req.include_usage, echo=echo if req.echo else None, logprobs=req.logprobs)
    return await respond(router, call, specs, lambda _: completion_decoder(router.tokenizer, stop),
                         renderer, req.stream)
