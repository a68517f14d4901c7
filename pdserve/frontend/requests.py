"""One API request's life: the OpenAI body → prompt → one ``ChoiceSpec`` per choice → the
choices' events → a JSON body or an SSE stream; abort and failure in one place.

* Chat: messages through the model's prompt format (``prompts``), the request's tool policy
  (``tools``) for the prompt and each choice's output parser (``output``), × n choices.
* Completions: prompts (text or ids, one or many) × n choices, plain text out.
* Responses (OpenAI's Responses API) and Messages (Anthropic's): turned into a chat request,
  answered in their own format (``responses``, ``messages``).
* Sampling: the OpenAI fields become one ``SamplingParams`` per choice (with a seed, choice i
  gets seed + i), after the context-length check.
* Answer: non-streaming waits for every choice (or the first error, answered with its status)
  while watching for the client to go away; streaming sends the opening chunks, one chunk per
  event, the usage chunk if asked, ``[DONE]`` (a Response: its own events, no ``[DONE]``); an
  error mid-stream is sent as an error event and the stream closed. Either way, leaving early
  cancels the generation, which aborts the rooms.

Each call is registered in ``Calls`` from its start to its end, so the router's drain can wait
for it or stop it (``CallTracker.stop``), and is counted in the router's metrics. The handlers
get a ``Serving`` (what answering needs), never the router object itself.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.frontend.choices import ChoiceEvent, ChoiceSpec, Generation, Services, route_text
from pdserve.frontend.admission import Admission
from pdserve.frontend.config import RouterConfig
from pdserve.frontend.errors import (RETRY_AFTER_S, APIError, body_for, context_too_long, invalid, model_not_found,
                                     unavailable)
from pdserve.frontend.json_calls import CallOrAnswerDecoder, JsonCallDecoder, call_openers
from pdserve.frontend.output import ChatOutput, OutputDecoder, completion_decoder
from pdserve.frontend.prompts import PromptBuilder
from pdserve.frontend.protocol import (ChatCompletionRequest, CompletionRequest, GenerationFields, MessagesRequest,
                                       ResponsesRequest)
from pdserve.frontend.render import DONE, ChatRenderer, CompletionRenderer, SSEResponse
from pdserve.frontend.messages import MessagesRenderer
from pdserve.frontend.messages import chat_request as messages_chat_request
from pdserve.frontend.response_store import ResponseStore, StoredResponse
from pdserve.frontend.responses import ResponsesRenderer, chat_request, history, resolve_references
from pdserve.frontend.tools import (ToolPolicy, check_constraint, for_prompt, json_calls, output_constraint,
                                    router_grammars)
from pdserve.frontend.workers import WorkerPool
from pdserve.metrics import RouterMetrics
from pdserve.structured import GrammarSpec
from pdserve.tokenizer import Tokenizer
from pdserve.worker_api import SamplingParams

logger = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request"
SAMPLING_EPS = 1e-5   # temperatures below this sample greedily
SEED_MODULUS = 2**63  # torch generators take non-negative 64-bit seeds; keep clear of the sign bit
Renderer = ChatRenderer | CompletionRenderer | ResponsesRenderer | MessagesRenderer


@dataclass
class Call:
    """One API call as the handlers see it."""

    endpoint: str        # the path, e.g. /v1/chat/completions (the metrics' label)
    request_id: str      # the X-Request-Id answered with
    room_base: str       # the workers' id for it (per choice: <room_base>-<i>)
    http: Request
    arrival: float


@dataclass
class Calls:
    """The router's calls in flight, as its drain sees them."""

    active: int = 0          # /v1 requests being handled (the middleware counts)
    draining: bool = False   # new requests get 503; those in flight go on
    closing: bool = False    # the drain timeout passed: what is left is stopped
    running: set[CallTracker] = field(default_factory=set)  # generations under way

    def __len__(self) -> int:
        return len(self.running)

    def __iter__(self) -> Iterator[CallTracker]:
        return iter(list(self.running))


@dataclass
class Serving:
    """What answering a request needs from the router process."""

    config: RouterConfig
    tokenizer: Tokenizer
    prompts: PromptBuilder
    output: ChatOutput          # the model's chat output grammar
    pool: WorkerPool
    services: Services          # what each choice needs (worker client, background tasks)
    metrics: RouterMetrics
    calls: Calls
    model_context: int          # the model's own context length, until a worker reports one
    admission: Admission | None = None  # the bounded queue in front of the workers (admission.py)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0))  # previous_response_id

    def check_model(self, name: str | None) -> str:
        """The served name for a request's "model" (None means the served model); else 404."""
        if name is None or name in self.config.model_names:
            return self.config.served_model_name
        raise model_not_found(name)

    @property
    def max_model_len(self) -> int:
        """The context a request may use: the smallest of --max-model-len and the workers' (each
        worker's is reconciled with its KV pool at start, so a request within it fits)."""
        lens = [n for n in (self.config.max_model_len, self.pool.max_model_len) if n]
        return min(lens) if lens else self.model_context

    @property
    def kv_tokens(self) -> int | None:
        """The tokens the smallest worker's KV pool holds (None until a worker reported)."""
        pools = [w.info.num_blocks * w.info.block_size for w in self.pool.workers if w.info is not None]
        return min(pools) if pools else None

    def check_fits(self, prompt_len: int, param: str) -> None:
        """400 for a prompt no worker's KV pool can hold, whatever the context says (a router
        started with a larger --max-model-len than its workers), before any work."""
        pool = self.kv_tokens
        if pool is not None and prompt_len >= pool:
            raise invalid(f"The {param} has {prompt_len} tokens; the workers' KV cache holds {pool}. "
                          f"Please reduce the length of the {param}.", param, "context_length_exceeded")


# ---- the endpoints -------------------------------------------------------------------------------


async def create_chat_completion(s: Serving, req: ChatCompletionRequest, call: Call,
                                 make_renderer: Callable[[str, int], Renderer] | None = None,
                                 truncate: bool = False) -> Response:
    """A chat completion; `make_renderer(model, prompt_tokens)` answers it in another format
    (the Responses API) instead; `truncate` drops the earliest turns that do not fit."""
    model = s.check_model(req.model)
    policy = ToolPolicy.of(req)
    constraint = await _constraint(s, req, policy)
    max_len = s.max_model_len
    if truncate:
        req, prompt = await s.prompts.chat_within(req, policy.prompt_tools, s.output.prompt_style,
                                                  min(max_len, s.kv_tokens or max_len), req.output_limit or 1)
    else:
        prompt = await s.prompts.chat(req, policy.prompt_tools, s.output.prompt_style, max_len)
    max_tokens = resolve_max_tokens(req.output_limit, len(prompt.ids), max_len, "messages")
    s.check_fits(len(prompt.ids), "messages")
    params = sampling_params(req, max_tokens, req.top_n, s.tokenizer.vocab_size)
    params.bad_words_ids = bad_words_ids(s.tokenizer, req.bad_words or [])
    if constraint is not None:  # where the grammar starts: tools.for_prompt
        params.structured = for_prompt(constraint, policy, s.output.profile, prompt.ids)
    rooms = room_ids(call.room_base, req.n)
    specs = [ChoiceSpec(i, rooms[i], prompt.ids, p) for i, p in enumerate(expand_choices(params, req.n))]
    stop, stop_ids = req.stop_list(), req.stop_token_ids or []
    renderer = make_renderer(model, len(prompt.ids)) if make_renderer is not None else ChatRenderer(
        f"chatcmpl-{call.request_id}", model, len(specs), len(prompt.ids), s.tokenizer,
        include_usage=req.include_usage, continuous_usage=req.continuous_usage, top_logprobs=req.top_n,
        prompt_ids=prompt.ids if req.return_token_ids else None, tokens_as_ids=req.return_tokens_as_token_ids,
        calls_only=policy.required and constraint is not None and constraint[1] == "tools")

    calls = constraint is not None and json_calls(constraint[1], s.output.profile)  # JSON calls (json_calls.py)

    def decoder(spec: ChoiceSpec) -> OutputDecoder:
        if calls and policy.answer is None:
            return JsonCallDecoder(s.tokenizer)
        text = s.output.decoder(spec.prompt_ids, stop, policy, stop_ids, req.include_stop_str_in_output,
                                req.skip_special_tokens)
        if calls:  # or an answer in response_format
            names = [t["function"]["name"] for t in policy.callable_tools]
            return CallOrAnswerDecoder(s.tokenizer, call_openers(names, policy.parallel), text)
        return text

    return await respond(s, call, specs, decoder, renderer, req.stream)


async def create_response(s: Serving, req: ResponsesRequest, call: Call) -> Response:
    """/v1/responses: the chat path, answered as a Response (responses.py); kept in the store
    unless the request says `store: false` (response_store.py)."""
    before = history(s.responses, req)
    req = resolve_references(s.responses, req, before)
    store = s.responses if req.store is not False and s.responses.enabled else None
    # a stored response's id must not repeat: a fresh one, not the client's X-Request-Id
    response_id = f"resp_{uuid.uuid4().hex}"
    logger.info("[%s] response %s%s", call.request_id, response_id,
                f", after {req.previous_response_id}" if req.previous_response_id else "")
    try:
        return await create_chat_completion(
            s, chat_request(req, before), call,
            lambda model, prompt_tokens: ResponsesRenderer(response_id, model, prompt_tokens, s.tokenizer, req,
                                                           before, store),
            truncate=req.truncation == "auto")
    except APIError as e:
        if e.param == "messages":  # what the client sent as `input`
            e.param = "input"
        raise


def stored_response(s: Serving, response_id: str) -> StoredResponse:
    """GET and DELETE /v1/responses/{id}: the stored response; 404 when it is not here."""
    stored = s.responses.get(response_id)
    if stored is None:
        raise APIError(f"Response with id '{response_id}' not found.", 404, "invalid_request_error", "response_id")
    return stored


def input_items_page(s: Serving, response_id: str, limit: int, order: str, after: str | None) -> dict[str, Any]:
    """GET /v1/responses/{id}/input_items: what the stored response was given (the continued
    conversation and its own input items), a page at a time, as OpenAI's list object."""
    items = list(stored_response(s, response_id).inputs)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise invalid(f"No input item with id '{after}' in response '{response_id}'.", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


async def create_message(s: Serving, req: MessagesRequest, call: Call) -> Response:
    """/v1/messages: the chat path, answered as an Anthropic message (messages.py)."""
    return await create_chat_completion(s, messages_chat_request(req), call, lambda model, prompt_tokens:
                                        MessagesRenderer(f"msg_{call.request_id}", model, prompt_tokens, s.tokenizer))


async def _constraint(s: Serving, req: GenerationFields, policy: ToolPolicy | None) -> tuple[GrammarSpec, str] | None:
    """The request's output constraint, compiled (cached) off the loop; 400 when it cannot be."""
    constraint = output_constraint(req, policy, s.output.profile)
    if constraint is not None and req.allowed_token_ids is not None:
        # the grammar's tokens and the allowed ones may have nothing in common
        raise invalid("allowed_token_ids cannot be combined with a structured output or a required tool call",
                      "allowed_token_ids")
    if constraint is not None:
        await check_constraint(router_grammars(s.tokenizer, s.metrics), *constraint)
    return constraint


async def create_completion(s: Serving, req: CompletionRequest, call: Call) -> Response:
    model = s.check_model(req.model)
    # max_tokens 0 scores the prompt (lm-eval's loglikelihood call): the worker samples one
    # token that is not shown; echo with logprobs asks the prefill for the prompt's logprobs
    score = req.max_tokens == 0
    prompt_top = req.logprobs if req.echo else None
    constraint = await _constraint(s, req, None)
    max_len = s.max_model_len
    prompts = await s.prompts.completion(req, max_len)
    rooms = room_ids(call.room_base, len(prompts) * req.n)
    specs: list[ChoiceSpec] = []
    echo: list[str] = []
    for p, prompt in enumerate(prompts):
        max_tokens = resolve_max_tokens(req.max_tokens, len(prompt.ids), max_len, "prompt")
        s.check_fits(len(prompt.ids), "prompt")
        params = sampling_params(req, max(max_tokens, 1), None if score else req.logprobs, s.tokenizer.vocab_size)
        params.bad_words_ids = bad_words_ids(s.tokenizer, req.bad_words or [])
        params.structured = constraint[0] if constraint else None
        params.prompt_logprobs = prompt_top
        for k, choice_params in enumerate(expand_choices(params, req.n)):
            index = p * req.n + k
            specs.append(ChoiceSpec(index, rooms[index], prompt.ids, choice_params, hide_output=score))
            echo.append(prompt.text)
    stop, include_stop = req.stop_list(), req.include_stop_str_in_output
    renderer = CompletionRenderer(
        f"cmpl-{call.request_id}", model, len(specs), sum(len(p.ids) for p in prompts), s.tokenizer,
        include_usage=req.include_usage, continuous_usage=req.continuous_usage, echo=echo if req.echo else None,
        logprobs=req.logprobs,
        echo_ids=[spec.prompt_ids for spec in specs] if req.echo else None,
        prompt_ids=[spec.prompt_ids for spec in specs] if req.return_token_ids else None,
        tokens_as_ids=req.return_tokens_as_token_ids)
    stop_ids, skip_special = req.stop_token_ids or [], req.skip_special_tokens
    return await respond(s, call, specs, lambda _: completion_decoder(s.tokenizer, stop, include_stop, stop_ids,
                                                                      skip_special), renderer, req.stream)


def room_ids(base: str, count: int) -> list[str]:
    return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]


# ---- sampling settings --------------------------------------------------------------------------


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str) -> int:
    """The output budget: as requested if prompt + output fit the context, else 400 with numbers.

    With no request (chat's default) the budget is whatever the context leaves.
    """
    if prompt_len >= max_model_len:
        raise context_too_long(max_model_len, prompt_len, requested, param)
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise context_too_long(max_model_len, prompt_len, requested, param)
    return requested


def sampling_params(req: GenerationFields, max_tokens: int, logprobs: int | None,
                    vocab_size: int) -> SamplingParams:
    """The request's sampling settings, checked; seeds are normalised, not yet per choice."""
    bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    bad = [t for t in bias if not 0 <= t < vocab_size]
    if bad:
        raise invalid(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {vocab_size})",
                      "logit_bias")
    stop_ids = list(req.stop_token_ids or [])
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise invalid(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    allowed = req.allowed_token_ids
    if allowed is not None and any(not 0 <= t < vocab_size for t in allowed):
        raise invalid(f"allowed_token_ids must be in [0, {vocab_size})", "allowed_token_ids")
    # a nucleus of mass 0 holds only the most likely token; a temperature under SAMPLING_EPS
    # (1e-300 is schema-valid) would overflow the logits' division: both are greedy, as in vLLM
    greedy = req.top_p == 0 or (req.temperature is not None and req.temperature < SAMPLING_EPS)
    params = SamplingParams(
        temperature=0.0 if greedy else 1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None or greedy else req.top_p,
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=bias,
        allowed_token_ids=None if allowed is None else sorted(set(allowed)),
        seed=None if req.seed is None else req.seed % SEED_MODULUS,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop_token_ids=stop_ids,
        stop=req.stop_list(),
        logprobs=logprobs,
        cache_salt=req.cache_salt,
        priority=req.priority,
    )
    try:
        params.validate()
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise invalid(str(e), name if hasattr(params, name) else None) from None
    return params


def bad_words_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's `bad_words` as token sequences: each word as it starts a text and as it follows a
    space (BPE vocabularies spell the two apart), once each."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def expand_choices(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n copies; with a seed, choice i gets seed + i so the choices differ yet reproduce."""
    if params.seed is None:
        return [dataclasses.replace(params) for _ in range(n)]
    return [dataclasses.replace(params, seed=(params.seed + i) % SEED_MODULUS) for i in range(n)]


# ---- the answer ---------------------------------------------------------------------------------


async def respond(s: Serving, call: Call, specs: list[ChoiceSpec],
                  make_decoder: Callable[[ChoiceSpec], OutputDecoder], renderer: Renderer, stream: bool) -> Response:
    if s.calls.closing:  # the drain timeout passed while this request was being read
        raise unavailable("The server is shutting down; retry the request.")
    params = specs[0].params if specs else None
    if params is not None and params.priority and s.config.scheduling_policy != "priority":
        raise invalid("priority is not honoured by this server: start it with --scheduling-policy priority "
                      "(or leave priority at 0)", "priority")
    batch = s.config.stream_batch if stream else 1 << 30
    if s.admission is None:
        gen = Generation(specs, make_decoder, s.pool, s.services, batch)  # 503 before start
    else:
        # waits for room; 429 when there is none. The prompt is the routing key (routing.py).
        key = (specs[0].prompt_ids, params.cache_salt, params.priority) if params else (None, None, 0)
        async with s.admission.admit(len(specs), *key) as ticket:
            gen = Generation(specs, make_decoder, ticket, s.services, batch)
    logger.info("[%s] %s: %d choice(s), %d prompt tokens, stream=%s, workers %s", call.request_id,
                call.endpoint, len(specs), renderer.prompt_tokens, stream,
                ", ".join(sorted({route_text(r.route) for r in gen.runs})))
    gen.start()
    tracker = CallTracker(s.calls, s.metrics, call, renderer, gen)
    if stream:
        events = gen.events()
        first = await _first_event(events, tracker, call.http)
        if isinstance(first, Response):
            return first
        return SSEResponse(_stream(first, events, renderer, tracker), on_close=tracker.finish)
    return await _collect(gen, renderer, tracker, call.http)


async def _first_event(events: AsyncIterator[ChoiceEvent], tracker: CallTracker,
                       http: Request) -> ChoiceEvent | None | Response:
    """A stream's status waits for its first event, so that an error found before the first
    token (a worker's refusal, a worker lost during prefill) is a real HTTP status with its
    param, not a 200 stream holding one error event. A Response when the call ends here."""
    first = asyncio.ensure_future(anext(events, None))
    gone = asyncio.create_task(_disconnected(http))
    streaming = False
    try:
        await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            logger.info("[%s] client went away before the first token; aborting", tracker.call.request_id)
            return Response(status_code=CLIENT_CLOSED)
        ev = first.result()
        if ev is None or ev.error is None:
            streaming = True  # the stream's response owns the call's end from here
            return ev
        tracker.saw(ev)
        tracker.status = ev.error.status
        return _error_response(ev.error, tracker.call.endpoint)
    finally:
        gone.cancel()
        if not streaming:
            first.cancel()
            tracker.finish()


def _error_response(error: APIError, path: str) -> JSONResponse:
    retry = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
    return JSONResponse(body_for(path, error), status_code=error.status, headers=retry)


async def _stream(first: ChoiceEvent | None, events: AsyncIterator[ChoiceEvent], renderer: Renderer,
                  tracker: CallTracker) -> AsyncGenerator[str, None]:
    """The SSE body, from the first event on. Its end, however it comes, is handled by
    `tracker.finish` (the response calls it even when the client left before the first byte
    and this never ran)."""
    for chunk in renderer.opening():
        yield renderer.sse(chunk)
    async for ev in _chain(first, events):
        tracker.saw(ev)
        if ev.error is not None:
            tracker.status = ev.error.status
            yield renderer.failure(ev.error)
            return
        for chunk in renderer.absorb(ev):
            yield renderer.sse(chunk)
    for chunk in renderer.closing():
        yield renderer.sse(chunk)
    renderer.done()
    if renderer.done_marker:
        yield DONE
    tracker.status = 200


async def _chain(first: ChoiceEvent | None, rest: AsyncIterator[ChoiceEvent]) -> AsyncIterator[ChoiceEvent]:
    if first is None:
        return
    yield first
    async for ev in rest:
        yield ev


async def _collect(gen: Generation, renderer: Renderer, tracker: CallTracker, http: Request) -> Response:
    async def run() -> APIError | None:
        async for ev in gen.events():
            tracker.saw(ev)
            if ev.error is not None:
                return ev.error
            renderer.absorb(ev)
        return None

    work = asyncio.create_task(run())
    gone = asyncio.create_task(_disconnected(http))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            logger.info("[%s] client went away; aborting", tracker.call.request_id)
            return Response(status_code=CLIENT_CLOSED)
        error = work.result()
        if error is not None:
            tracker.status = error.status
            return _error_response(error, tracker.call.endpoint)
        tracker.status = 200
        renderer.done()
        return JSONResponse(renderer.response())
    finally:
        work.cancel()
        gone.cancel()
        tracker.finish()


async def _disconnected(http: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


class CallTracker:
    """One call from its start to its end: stop what still runs, count it, log it (once)."""

    def __init__(self, calls: Calls, metrics: RouterMetrics, call: Call, renderer: Renderer,
                 gen: Generation) -> None:
        self.calls = calls
        self.call = call
        self.renderer = renderer
        self.gen = gen
        self.status = CLIENT_CLOSED  # until the call ends otherwise
        self.stopped = False         # ended by the router's drain
        self.first_token: float | None = None
        self.timer = metrics.start_request(renderer.prompt_tokens, call.arrival)
        self._finished = False
        calls.running.add(self)

    def saw(self, ev: ChoiceEvent) -> None:
        if ev.batch is not None and ev.batch.token_ids:
            if self.first_token is None:
                self.first_token = time.monotonic()
            self.timer.tokens(len(ev.batch.token_ids), ev.index)

    def stop(self, error: APIError) -> None:
        """The router drains and time is up: every choice still running ends with `error`."""
        self.stopped = True
        self.gen.fail(error, "drain")

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self.calls.running.discard(self)
        # A no-op for choices that ended; aborts the rooms of the others.
        self.gen.cancel("client" if self.status == CLIENT_CLOSED else "router")
        self.timer.finish(self._reason())
        elapsed = time.monotonic() - self.call.arrival
        ttft = f"{self.first_token - self.call.arrival:.3f}s" if self.first_token else "-"
        logger.info("[%s] %s done: status %d, %d completion tokens, ttft %s, e2e %.3fs",
                    self.call.request_id, self.call.endpoint, self.status, self.renderer.completion_tokens,
                    ttft, elapsed)

    def _reason(self) -> str:
        """The call's finish reason for the metrics: the choices' as the client saw them (the
        strongest when they differ), "abort" when the client left or the drain stopped it."""
        if self.status == 200:
            reasons = {c.finish_reason for c in self.renderer.choices}
            return next((r for r in ("tool_calls", "length") if r in reasons), "stop")
        return "abort" if self.status == CLIENT_CLOSED or self.stopped else "error"
