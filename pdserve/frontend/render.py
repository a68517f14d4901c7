"""Choice events → OpenAI response bodies and stream chunks (chat and text completions), and
the chunks as server-sent events (``data: <json>\\n\\n`` … ``data: [DONE]\\n\\n``).

A renderer keeps each choice's text, reasoning, tool calls, token count and logprobs.
``absorb`` takes one event and returns its stream chunks (none when it carries nothing to
send); ``response`` is the non-streaming body, built from the same state, so streaming and
non-streaming answers aggregate to the same message.

Chat chunks keep the order of the parser's events: a new chunk starts whenever the kind
switches between reasoning, content and tool calls. A tool call's first delta carries its
index, id, type and name with empty arguments; argument fragments follow in later chunks.

Calls the model wrote that are not returned as calls (the output ended inside them, or their
arguments are not valid; ``InvalidCall``) are reported apart, never as content:
``message.invalid_tool_calls`` (``[{index, name, text, reason}]``) in the non-streaming body,
and the same list as ``choices[i].invalid_tool_calls`` in the choice's final chunk, beside its
finish_reason (not in the delta: OpenAI's stream helpers merge lists in a delta by an integer
`index`, and an unsent call has none). A call whose start was already
streamed carries its index there (the client drops that call) and is left out of
``message.tool_calls``; ``index`` is null for a call of which nothing was sent.
"""
from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.frontend.choices import ChoiceEvent
from pdserve.frontend.errors import APIError
from pdserve.frontend.output import Part
from pdserve.parsers import ContentDelta, InvalidCall, ReasoningDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from pdserve.tokenizer import Tokenizer
from pdserve.worker_api import TokenLogprob

DONE = "data: [DONE]\n\n"


def version() -> str:
    """pdserve's installed version (what GET /version answers)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("pdserve")
    except PackageNotFoundError:
        return "0+unknown"


SYSTEM_FINGERPRINT = f"fp_pdserve_{version()}"  # chat responses name the backend that answered
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class CallState:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    complete: bool = False

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": "".join(self.arguments)}}


@dataclass
class ChoiceState:
    pieces: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, CallState] = field(default_factory=dict)  # by the call's index
    invalid: list[dict[str, Any]] = field(default_factory=list)  # reported calls (InvalidCall)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0
    offset: int = 0  # characters of text so far (completion logprobs' text_offset)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo with logprobs: the worker's
    echoed: bool = False  # the echo went out (streaming with logprobs: with the first event)
    token_ids: list[int] = field(default_factory=list)  # every token the choice sampled, in order
    ids_sent: bool = False  # completions streaming with return_token_ids: its prompt's ids went out
    cached_tokens: int = 0  # prompt tokens the worker took from its prefix cache
    stop_sequence: str | None = None  # the stop string that ended the text, if one did
    stop_token: int | None = None     # the request's stop token id that ended it, if one did

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's: the stop string or the request's stop token id that ended the choice; None
        for the model's own end, a length cut, or a choice still running."""
        return self.stop_sequence if self.stop_sequence is not None else self.stop_token


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def token_name(tokenizer: Tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, or vLLM's ``token_id:<id>`` (return_tokens_as_token_ids,
    for tokens whose text alone does not say which they are: a byte of a character, a special token)."""
    return f"token_id:{token_id}" if as_id else token_text(tokenizer, token_id)


def token_logprob(tokenizer: Tokenizer, lp: TokenLogprob, n: int, as_id: bool = False) -> dict[str, Any]:
    """A chat (or Responses) logprob entry: the token, its logprob and bytes, and the `n` most
    likely tokens likewise."""
    top = [{"token": token_name(tokenizer, t, as_id), "logprob": v, "bytes": list(tokenizer.token_bytes(t))}
           for t, v in lp.top[:n]]
    return {"token": token_name(tokenizer, lp.token_id, as_id), "logprob": lp.logprob,
            "bytes": list(tokenizer.token_bytes(lp.token_id)), "top_logprobs": top}


def legacy_top(tokenizer: Tokenizer, lp: TokenLogprob, n: int, as_id: bool = False) -> dict[str, float]:
    """A text completion's ``top_logprobs`` entry: the ``n`` most likely tokens and the chosen
    one, which OpenAI always adds (so up to ``n + 1`` entries; ``n = 0`` gives the chosen only)."""
    top = {token_name(tokenizer, t, as_id): v for t, v in lp.top[:n]}
    top.setdefault(token_name(tokenizer, lp.token_id, as_id), lp.logprob)
    return top


class Renderer:
    """What chat and text completions share: ids, envelopes, usage, per-choice state."""

    object_name = ""
    chunk_object_name = ""
    done_marker = True  # a stream ends with `data: [DONE]`

    def sse(self, payload: dict[str, Any]) -> str:
        """One stream event as sent."""
        return event(payload)

    def closing(self) -> list[dict[str, Any]]:
        """The stream's last events, after every choice ended: the usage, when asked for."""
        return [self.usage_chunk()] if self.include_usage else []

    def failure(self, error: APIError) -> str:
        """What ends a stream that failed: an OpenAI error object (no [DONE] follows)."""
        return error_event(error)

    def done(self) -> None:
        """The answer ended well: every choice finished and no error came (what outlives the
        call, a stored response, is kept here)."""

    def __init__(self, response_id: str, model: str, num_choices: int, prompt_tokens: int,
                 tokenizer: Tokenizer, include_usage: bool = False, continuous_usage: bool = False) -> None:
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # every chunk's usage is the count so far, not null
        self.choices = [ChoiceState() for _ in range(num_choices)]

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def usage(self) -> dict[str, Any]:
        out: dict[str, Any] = usage(self.prompt_tokens, self.completion_tokens)
        # the prompt counts once, as OpenAI reports it: the first choice's prefix cache hits
        out["prompt_tokens_details"] = {"cached_tokens": self.choices[0].cached_tokens if self.choices else 0}
        return out

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": self.chunk_object_name, "created": self.created,
                               "model": self.model, "choices": choices, **self.fingerprint()}
        if self.include_usage:
            out["usage"] = self.usage() if self.continuous_usage else None
        return out

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object_name, "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage(), **self.fingerprint()}

    def fingerprint(self) -> dict[str, Any]:
        return {}

    def _update(self, ev: ChoiceEvent, text: str) -> ChoiceState:
        state = self.choices[ev.index]
        state.num_tokens = ev.num_tokens
        if text:
            state.pieces.append(text)
        if ev.batch is not None:
            state.token_ids.extend(ev.batch.token_ids)
            state.logprobs.extend(ev.batch.logprobs)
            if ev.batch.prompt_logprobs is not None:
                state.prompt_logprobs = ev.batch.prompt_logprobs
        if ev.finish_reason is not None:
            state.finish_reason = ev.finish_reason
        if ev.cached_tokens is not None:
            state.cached_tokens = ev.cached_tokens
        if ev.stop_sequence is not None:
            state.stop_sequence = ev.stop_sequence
        if ev.stop_token is not None:
            state.stop_token = ev.stop_token
        return state


class ChatRenderer(Renderer):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, top_logprobs: int | None = None, prompt_ids: list[int] | None = None,
                 tokens_as_ids: bool = False, calls_only: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.prompt_ids = prompt_ids      # vLLM's return_token_ids: the prompt's ids (None: no ids)
        self.tokens_as_ids = tokens_as_ids  # logprobs name tokens `token_id:<id>`
        self.calls_only = calls_only      # a grammar forces calls: the content stays null

    def opening(self) -> list[dict[str, Any]]:
        """The first chunk of every choice names the role, as OpenAI's do (the first one also
        the prompt's token ids, when asked). Its content is "" where text may follow and null
        where only calls can (OpenAI's: a client opens no text part for them)."""
        content = None if self.calls_only else ""
        chunks = [self.chunk([{"index": i, "delta": {"role": "assistant", "content": content},
                               "logprobs": None, "finish_reason": None}])
                  for i in range(len(self.choices))]
        if chunks and self.prompt_ids is not None:
            chunks[0]["prompt_token_ids"] = self.prompt_ids
        return chunks

    def absorb(self, ev: ChoiceEvent) -> list[dict[str, Any]]:
        state = self._update(ev, "")
        lps = ev.batch.logprobs if ev.batch is not None else []
        ids = ev.batch.token_ids if ev.batch is not None and self.prompt_ids is not None else []
        deltas = _deltas(state, ev.batch.delta.parts if ev.batch is not None else [])
        if not deltas and (lps or ids or ev.finish_reason is not None):
            deltas = [{}]
        entries = [{"index": ev.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if entries:  # the batch's logprobs, token ids and the finish go with its last chunk
            entries[-1].update(logprobs=self._logprobs(lps), finish_reason=ev.finish_reason)
            if self.prompt_ids is not None:
                entries[-1]["token_ids"] = ids
            if ev.finish_reason is not None:
                entries[-1]["stop_reason"] = state.stop_reason
                if state.invalid:  # reported once, beside the finish
                    entries[-1]["invalid_tool_calls"] = state.invalid
        return [self.chunk([e]) for e in entries]

    def response(self) -> dict[str, Any]:
        choices = [{"index": i, "message": _message(c), "logprobs": self._logprobs(c.logprobs),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    **({"token_ids": c.token_ids} if self.prompt_ids is not None else {})}
                   for i, c in enumerate(self.choices)]
        ids = {"prompt_token_ids": self.prompt_ids} if self.prompt_ids is not None else {}
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(), **ids, **self.fingerprint()}

    def fingerprint(self) -> dict[str, Any]:
        return {"system_fingerprint": SYSTEM_FINGERPRINT}

    def _logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        entries = [token_logprob(self.tokenizer, lp, self.top_logprobs, self.tokens_as_ids) for lp in lps]
        return {"content": entries, "refusal": None}


def _message(c: ChoiceState) -> dict[str, Any]:
    """The non-streaming message: content (null when the answer is only tool calls), reasoning
    in `reasoning_content` and mirrored in `reasoning`, calls in index order."""
    message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
    if c.reasoning:
        message["reasoning_content"] = message["reasoning"] = "".join(c.reasoning)
    if c.calls:
        message["content"] = c.text or None
        message["tool_calls"] = [c.calls[i].message() for i in sorted(c.calls)]
    if c.invalid:
        message["invalid_tool_calls"] = c.invalid
    return message


def _deltas(state: ChoiceState, parts: list[Part]) -> list[dict[str, Any]]:
    """One batch's parts → stream deltas, in order, one per run of a kind; recorded in `state`."""
    out: list[dict[str, Any]] = []
    run: list[str] = []
    kind: object = None  # "content" | "reasoning" | the call index of an argument run

    def flush() -> None:
        if run:
            text = "".join(run)
            if kind == "content":
                out.append({"content": text})
            elif kind == "reasoning":
                out.append({"reasoning_content": text, "reasoning": text})
            else:
                out.append({"tool_calls": [{"index": kind, "function": {"arguments": text}}]})
            run.clear()

    for part in parts:
        if isinstance(part, ToolCallStart):
            flush()
            state.calls[part.index] = CallState(part.id, part.name)
            out.append({"tool_calls": [{"index": part.index, "id": part.id, "type": "function",
                                        "function": {"name": part.name, "arguments": ""}}]})
            kind = None
            continue
        if isinstance(part, ToolCallEnd):
            state.calls[part.index].complete = part.complete
            continue
        if isinstance(part, InvalidCall):
            if part.index is not None:  # streamed already: the client drops it, the message leaves it out
                state.calls.pop(part.index, None)
            state.invalid.append({"index": part.index, "name": part.name, "text": part.text,
                                  "reason": part.reason})
            continue
        if isinstance(part, ContentDelta):
            this, text = "content", part.text
            state.pieces.append(text)
        elif isinstance(part, ReasoningDelta):
            this, text = "reasoning", part.text
            state.reasoning.append(text)
        elif isinstance(part, ToolCallArgs):
            this, text = part.index, part.fragment
            state.calls[part.index].arguments.append(text)
        else:
            continue
        if this != kind:
            flush()
            kind = this
        run.append(text)
    flush()
    return out


class ItemRenderer(Renderer, ABC):
    """One choice's parser events as items opened in the order the model wrote them: a run of
    text, a run of reasoning, one item per tool call (the Responses API's output items, the
    Messages API's content blocks). This class keeps which item is open and which call is
    which; a subclass makes its items and their stream events through the hooks below. Both
    APIs stream typed events (``event: <type>`` and ``data: <json>``) and no ``[DONE]``."""

    done_marker = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kinds: list[str] = []       # per item: "text", "reasoning" or "call"
        self.open: int | None = None     # the item taking deltas
        self.calls: dict[int, int] = {}  # the parser's call index → its item

    def sse(self, payload: dict[str, Any]) -> str:
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {payload['type']}\ndata: {data}\n\n"

    def absorb(self, ev: ChoiceEvent) -> list[dict[str, Any]]:
        self._update(ev, "")
        out: list[dict[str, Any]] = []
        if ev.batch is not None:  # token by token, each before the parts it wrote
            batch, start = ev.batch, 0
            for k, end in enumerate(batch.part_ends):
                self._token(batch.token_ids[k], batch.logprobs[k] if k < len(batch.logprobs) else None)
                for part in batch.delta.parts[start:end]:
                    out += self._part(part)
                start = end
            for part in batch.delta.parts[start:]:
                out += self._part(part)
        if ev.finish_reason is not None:
            out += self._close(final=True)
        return out

    def _part(self, part: Part) -> list[dict[str, Any]]:
        state = self.choices[0]
        if isinstance(part, (ContentDelta, ReasoningDelta)):
            kind = "text" if isinstance(part, ContentDelta) else "reasoning"
            (state.pieces if kind == "text" else state.reasoning).append(part.text)
            out: list[dict[str, Any]] = []
            if self.open is None or self.kinds[self.open] != kind:
                out = self._close() + self._opened(self._new(kind), kind)
            return out + self._text(self.open, part.text)
        if isinstance(part, ToolCallStart):
            out = self._close()
            self.calls[part.index] = self._new("call")
            return out + self._call_opened(self.open, part)
        if isinstance(part, ToolCallArgs):
            return self._call_args(self.calls[part.index], part.fragment)
        if isinstance(part, ToolCallEnd):
            index = self.calls[part.index]
            self._call_ended(index, part.complete)
            return self._close() if self.open == index else []
        if isinstance(part, InvalidCall):
            state.invalid.append({"index": part.index, "name": part.name, "text": part.text, "reason": part.reason})
            if part.index is not None:  # streamed already: it must not read as a call to run
                index = self.calls[part.index]
                self._call_invalid(index)
                return self._close() if self.open == index else []
        return []

    def _new(self, kind: str) -> int:
        self.kinds.append(kind)
        self.open = len(self.kinds) - 1
        return self.open

    def _close(self, final: bool = False) -> list[dict[str, Any]]:
        """The open item's end; `final`: the output ended (else another item follows it)."""
        if self.open is None:
            return []
        index, self.open = self.open, None
        return self._closed(index, final)

    # ---- the hooks: each returns the stream events it makes ------------------------------------

    def _token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        """A token comes; the parts it wrote (maybe none yet: text held back) follow."""

    @abstractmethod
    def _opened(self, index: int, kind: str) -> list[dict[str, Any]]:
        """Item `index` starts: a run of "text" or "reasoning"."""

    @abstractmethod
    def _text(self, index: int, text: str) -> list[dict[str, Any]]:
        ...

    @abstractmethod
    def _call_opened(self, index: int, call: ToolCallStart) -> list[dict[str, Any]]:
        ...

    @abstractmethod
    def _call_args(self, index: int, fragment: str) -> list[dict[str, Any]]:
        ...

    def _call_ended(self, index: int, complete: bool) -> None:
        """The call's arguments are all there (`complete`: the output did not end inside them)."""

    def _call_invalid(self, index: int) -> None:
        """The call turned out not to be a valid call."""

    @abstractmethod
    def _closed(self, index: int, final: bool) -> list[dict[str, Any]]:
        ...


class CompletionRenderer(Renderer):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args: Any, echo: list[str] | None = None, logprobs: int | None = None,
                 echo_ids: list[list[int]] | None = None, prompt_ids: list[list[int]] | None = None,
                 tokens_as_ids: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo          # per choice: the prompt text to print before the output
        self.echo_ids = echo_ids  # per choice: the prompt's token ids (echo with logprobs)
        self.logprobs = logprobs  # None: no logprobs; N: the top N alternatives
        self.prompt_ids = prompt_ids  # per choice (vLLM's return_token_ids; None: no ids)
        self.tokens_as_ids = tokens_as_ids  # logprobs name tokens `token_id:<id>`
        for state, prefix in zip(self.choices, echo or []):
            state.offset = len(prefix)

    @property
    def _echo_logprobs(self) -> bool:
        return bool(self.echo) and self.logprobs is not None

    def opening(self) -> list[dict[str, Any]]:
        """The echoed prompts first; with logprobs each goes with its choice's first event,
        which brings the prompt's logprobs."""
        if not self.echo or self._echo_logprobs:
            return []
        return [self.chunk([{"index": i, "text": text, "logprobs": None, "finish_reason": None}])
                for i, text in enumerate(self.echo)]

    def absorb(self, ev: ChoiceEvent) -> list[dict[str, Any]]:
        text = ev.batch.delta.content if ev.batch is not None else ""
        state = self.choices[ev.index]
        start = state.offset
        self._update(ev, text)
        out = []
        if self._echo_logprobs and not state.echoed:
            state.echoed = True
            out.append(self.chunk([{"index": ev.index, "text": self.echo[ev.index],
                                    "logprobs": self._prompt_logprobs(ev.index), "finish_reason": None}]))
        lps = ev.batch.logprobs if ev.batch is not None else []
        formatted = self._logprobs(lps, start)
        state.offset = start + sum(len(token_text(self.tokenizer, lp.token_id)) for lp in lps)
        ids = ev.batch.token_ids if ev.batch is not None and self.prompt_ids is not None else []
        if not text and not lps and not ids and ev.finish_reason is None:
            return out
        entry = {"index": ev.index, "text": text, "logprobs": formatted, "finish_reason": ev.finish_reason}
        if ev.finish_reason is not None:
            entry["stop_reason"] = state.stop_reason
        if self.prompt_ids is not None:  # the prompt's ids with the choice's first chunk, as vLLM's
            entry["token_ids"] = ids
            if not state.ids_sent:
                state.ids_sent = True
                entry["prompt_token_ids"] = self.prompt_ids[ev.index]
        return out + [self.chunk([entry])]

    def response(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            prefix = self.echo[i] if self.echo else ""
            logprobs = self._logprobs(c.logprobs, len(prefix))
            if self._echo_logprobs:  # the prompt's entries, then the output's
                prompt = self._prompt_logprobs(i)
                logprobs = {k: prompt[k] + logprobs[k] for k in prompt}
            choices.append({"index": i, "text": prefix + c.text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if self.prompt_ids is not None:
                choices[-1].update(prompt_token_ids=self.prompt_ids[i], token_ids=c.token_ids)
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    def _logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        tok, as_id = self.tokenizer, self.tokens_as_ids
        offsets = []
        for lp in lps:
            offsets.append(offset)
            offset += len(token_text(tok, lp.token_id))
        return {"tokens": [token_name(tok, lp.token_id, as_id) for lp in lps],
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [legacy_top(tok, lp, self.logprobs, as_id) for lp in lps],
                "text_offset": offsets}

    def _prompt_logprobs(self, index: int) -> dict[str, Any]:
        """The echoed prompt's entries: its tokens, their logprobs (the first null: nothing
        precedes it) and top alternatives, offsets from the start of the prompt text."""
        tok = self.tokenizer
        ids = self.echo_ids[index] if self.echo_ids else []
        entries = self.choices[index].prompt_logprobs or [None] * len(ids)
        offsets, at = [], 0
        for t in ids:
            offsets.append(at)
            at += len(token_text(tok, t))
        as_id = self.tokens_as_ids
        return {"tokens": [token_name(tok, t, as_id) for t in ids],
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else legacy_top(tok, e, self.logprobs, as_id) for e in entries],
                "text_offset": offsets}


# ---- server-sent events ----------------------------------------------------------------------


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(error: APIError) -> str:
    """The last event of a stream that failed: an OpenAI error object (no [DONE] follows)."""
    return event(error.body())


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its generator when it ends, however it ends.

    Starlette stops iterating when the client disconnects; the generator is closed at once (not
    whenever it is collected) and ``on_close`` runs, which aborts the request on the workers.
    """

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type=MEDIA_TYPE, headers={**HEADERS, **(headers or {})})
        self._generator = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._generator.aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()
