"""The router ↔ worker contract: every message of the workers' internal HTTP API, typed once.

The router builds its requests from these models and reads the workers' answers with them;
the worker's HTTP server (``pdserve.worker.server``) validates the same models and answers
with them; the tests' worker client does too. ``pdserve/worker/API.md`` describes the same
messages for people, and ``tests/test_worker_api.py`` checks it names every field here.

Why a top-level module and not ``pdserve/worker/api.py``: importing anything under
``pdserve.worker`` runs that package's ``__init__``, and the package belongs to the worker
process (its modules load torch and the engine). The router process must import the contract
without any of that, so the contract lives beside the packages and imports nothing of pdserve:
only pydantic. ``SamplingParams`` is defined here for the same reason (it is the ``params`` of
/generate and /prefill); the engine re-exports it from ``pdserve.engine.sampling_params``.

One request, PD (a colocated "both" worker skips the /prefill leg):

1. router → decode ``POST /generate`` (``GenerateRequest``); the answer streams NDJSON lines.
2. decode → router: a ``RoomLine`` once the room's KV blocks are allocated.
3. router → prefill ``POST /prefill`` (``PrefillRequest``, with the room's blocks); prefill
   writes the KV (and the first token) into those blocks and answers ``PrefillDone`` — or an
   error status with an ``ErrorBody`` (``ErrorCode`` says which failure).
4. decode → router: ``TokenLine``s; the last one has ``finish_reason`` set.
5. Either side, any time, any number of times: ``POST /abort`` (``AbortRequest``).
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Annotated, Union

from pydantic import BaseModel, ConfigDict, Field

NDJSON = "application/x-ndjson"
RETRY_AFTER_S = 5  # a draining worker's 503 says when to retry


# ---- sampling -------------------------------------------------------------------------------


class GrammarKind(str, enum.Enum):
    """What a ``GrammarSpec.value`` is (``pdserve.structured`` compiles it)."""

    JSON_SCHEMA = "json_schema"  # a JSON Schema, as JSON text (json_object: {"type": "object"})
    REGEX = "regex"
    CHOICE = "choice"            # a JSON list of strings: the output is exactly one of them
    GRAMMAR = "grammar"          # a Lark or GBNF grammar


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output, as sent: every worker compiles (and caches) it itself.

    ``strict`` false: JSON Schema keywords the backend does not implement are ignored instead
    of refused (OpenAI's non-strict ``json_schema``). ``start_after``: a token id (the end of
    a reasoning section); the grammar applies to the output after its first occurrence only."""

    kind: GrammarKind
    value: str
    strict: bool = True
    start_after: int | None = None


@dataclass
class SamplingParams:
    """OpenAI-style sampling and stopping settings (and how the request may share the prefix
    cache). `temperature == 0` means greedy.

    On the wire (``GenerateRequest.params``) every field but ``stop`` travels: stop *strings*
    are the router's (it detokenizes, cuts the text, and aborts the request on the workers).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None  # None: any token; else only these are sampled
    # token sequences never completed: a sequence's last token is banned wherever the output so
    # far ends with the rest of it (vLLM's bad_words, tokenized by the router)
    bad_words_ids: list[list[int]] = field(default_factory=list)
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, matched on detokenized text
    logprobs: int | None = None  # None: no logprobs; N: the sampled token's plus the top N
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's (after the first) + top N
    structured: GrammarSpec | None = None  # None: unconstrained; else only its grammar's tokens
    # the prompt's last N ids are this choice's own output from an earlier attempt (the router
    # goes on elsewhere when a worker failed it): penalties count them, a grammar has read them,
    # and a seed draws as if they had been drawn here; max_tokens and min_tokens count only
    # the tokens still to come
    resumed_tokens: int = 0
    # vLLM's cache_salt: the request's cached blocks are named under it too, so it shares prefix
    # blocks only with requests that send the same salt (tenants cannot time each other's
    # prompts); None: the worker's shared chain
    cache_salt: str | None = None
    # vLLM's priority: lower is sooner. A worker starts waiting requests and preempts running
    # ones in its order (FIFO among equals); the router's queue honours it under
    # --scheduling-policy priority, and otherwise sends 0
    priority: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError("prompt_logprobs must be in [0, 20]")
        if self.resumed_tokens < 0:
            raise ValueError("resumed_tokens must be >= 0")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if any(not ids for ids in self.bad_words_ids):
            raise ValueError("bad_words_ids must not hold an empty sequence")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class _Message(BaseModel):
    """Unknown fields are ignored both ways, so either side may add one before the other reads it."""

    model_config = ConfigDict(extra="ignore")

    def wire(self) -> dict:
        """The JSON-ready body (what goes into ``httpx``'s ``json=``)."""
        return self.model_dump(mode="json", exclude=self._excluded())

    def wire_json(self) -> bytes:
        """The same body serialized by pydantic: a long prompt's ids in ≈ a third of the time
        that ``json.dumps`` of ``wire()`` takes (2.4 against 7.5 ms for 64,000 ids). Messages
        with floats that may be infinite (logprobs) keep ``wire()``: this writes those as null."""
        return self.model_dump_json(exclude=self._excluded()).encode()

    def _excluded(self) -> dict | None:
        return _NO_STOP if "params" in type(self).model_fields else None


_NO_STOP = {"params": {"stop"}}
RequestId = Annotated[str, Field(min_length=1, max_length=256)]


# ---- enums ----------------------------------------------------------------------------------


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"     # colocated: prefill and decode in one worker, no KV transfer


class FinishReason(str, enum.Enum):
    """How a request ended on a decode (or colocated) worker: the last ``TokenLine``."""

    STOP = "stop"      # an EOS or stop token
    LENGTH = "length"  # max_tokens (or the context) reached
    ABORT = "abort"    # aborted: by /abort, by a closed stream, or a transfer that was given up
    ERROR = "error"    # the request failed on the worker (``TokenLine.error`` says why)

    @property
    def normal(self) -> bool:
        """The model finished: nothing is left to abort."""
        return self in (FinishReason.STOP, FinishReason.LENGTH)


class HealthStatus(str, enum.Enum):
    OK = "ok"
    DRAINING = "draining"  # shutting down: no new requests, those in flight go on
    WEDGED = "wedged"      # no loop step for --health-stall-timeout seconds
    FAILED = "failed"      # the loop died


class ErrorCode(str, enum.Enum):
    """Why a call failed; each code has one HTTP status (``ErrorCode.status``)."""

    BAD_REQUEST = "bad_request"                # the body is malformed or its values invalid
    NOT_SERVED = "not_served"                  # this worker's role does not serve the path
    DRAINING = "draining"                      # shutting down (Retry-After)
    PREFILL_FAILED = "prefill_failed"          # the prefill or its KV transfer failed
    DECODE_UNREACHABLE = "decode_unreachable"  # /prefill could not reach the decode worker
    ABORTED = "aborted"                        # the request was aborted while /prefill ran
    UNAUTHORIZED = "unauthorized"              # the internal token is missing or wrong

    @property
    def status(self) -> int:
        return _STATUS[self]

    @property
    def prefill_failure(self) -> bool:
        """The prefill itself failed (as opposed to the call being refused)."""
        return self in (ErrorCode.PREFILL_FAILED, ErrorCode.DECODE_UNREACHABLE, ErrorCode.ABORTED)


_STATUS = {ErrorCode.BAD_REQUEST: 400, ErrorCode.NOT_SERVED: 404, ErrorCode.DRAINING: 503,
           ErrorCode.PREFILL_FAILED: 500, ErrorCode.DECODE_UNREACHABLE: 502, ErrorCode.ABORTED: 409,
           ErrorCode.UNAUTHORIZED: 401}


# ---- errors ---------------------------------------------------------------------------------


class ErrorDetail(_Message):
    message: str
    type: str          # "invalid_request_error" (4xx) | "server_error" (5xx), as OpenAI's
    code: ErrorCode


class ErrorBody(_Message):
    """Every non-2xx answer of a worker: ``{"error": {"message", "type", "code"}}``."""

    error: ErrorDetail

    @classmethod
    def of(cls, code: ErrorCode, message: str) -> ErrorBody:
        kind = "server_error" if code.status >= 500 else "invalid_request_error"
        return cls(error=ErrorDetail(message=message, type=kind, code=code))


# ---- /generate ------------------------------------------------------------------------------


class GenerateRequest(_Message):
    """POST /generate (roles decode and both)."""

    request_id: RequestId            # the room id: unique per choice, chosen by the router
    prompt_ids: list[int] = Field(min_length=1)
    params: SamplingParams = Field(default_factory=SamplingParams)
    prefill_url: str | None = None         # decode role: the prefill worker the router will call
    prefill_worker_id: str | None = None   # decode role (required): its /info worker_id
    prefill_incarnation: str | None = None  # its /info incarnation: a late /peers/dead for an older one spares this room


class Room(_Message):
    request_id: str
    blocks: list[int]          # the decode worker's KV blocks the prefill worker writes into
    worker_id: str             # the decode worker's id (its /bootstrap)
    decode_url: str | None = None  # where prefill finds /bootstrap; None: the URL the router used
    # the prompt's leading blocks the decode worker's prefix cache holds already: prefill skips
    # that many of its own and writes the rest into `blocks` (which never names a cached block)
    cached_blocks: int = Field(0, ge=0)


class RoomLine(_Message):
    """The first line of a PD /generate stream: the room's blocks are allocated."""

    room: Room


LOGPROB_FLOOR = -9999.0  # a logprob of -inf (a token a grammar rules out) as sent: JSON has no -inf


class TokenLogprob(_Message):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


class TokenLine(_Message):
    """Tokens of one step; the last line of the stream has ``finish_reason`` set."""

    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    # with the first token, when ``params.prompt_logprobs`` is set: one per prompt token, the
    # first null (nothing precedes it); computed by the worker that ran the prefill
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    # with an ``error`` finish: the KV transfer failed because the prefill worker died (not a
    # fault of this request: the router answers 503, which the client may retry)
    peer_dead: bool = False
    # with an ``error`` finish: a TP rank process of this worker died, so the worker stops (not a
    # fault of this request either: 503, and the router may run it again elsewhere)
    worker_died: bool = False
    cached_tokens: int | None = None  # with the finish: prompt tokens reused from the prefix cache


StreamLine = Union[RoomLine, TokenLine]


def parse_line(text: str) -> StreamLine:
    """One NDJSON line of a /generate stream; ValueError (pydantic's is one) when it is neither."""
    obj = json.loads(text)
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object: {text[:80]!r}")
    return RoomLine.model_validate(obj) if "room" in obj else TokenLine.model_validate(obj)


def line(message: StreamLine) -> bytes:
    return (json.dumps(message.wire()) + "\n").encode()


# ---- /prefill -------------------------------------------------------------------------------


class DecodeTarget(_Message):
    worker_id: str
    decode_url: str
    blocks: list[int]
    incarnation: str | None = None  # the decode worker's /info incarnation (see /peers/dead)
    cached_blocks: int = Field(0, ge=0)  # Room.cached_blocks: the prompt's leading blocks not sent


class PrefillRequest(_Message):
    """POST /prefill (role prefill): prefill, then write the KV into ``decode.blocks``."""

    request_id: RequestId
    prompt_ids: list[int] = Field(min_length=1)
    params: SamplingParams = Field(default_factory=SamplingParams)
    decode: DecodeTarget


class PrefillDone(_Message):
    """200 from /prefill: the KV (and the first token) are in the decode worker's blocks.
    A failure is an error status with an ``ErrorBody`` instead."""

    status: str = "done"
    cached_tokens: int = 0  # prompt tokens reused from the prefill worker's prefix cache


# ---- /abort ---------------------------------------------------------------------------------


class AbortRequest(_Message):
    request_id: RequestId
    origin: str = "router"  # who asked: one of pdserve.metrics.ABORT_ORIGINS


class AbortResult(_Message):
    ok: bool = True
    aborted: bool  # it ran here and this call counted its abort


# ---- /peers/dead ----------------------------------------------------------------------------


class PeerDead(_Message):
    """POST /peers/dead: the worker `worker_id` (process `incarnation`) is dead, every one of
    its ranks (its supervisor saw them exit). The rooms this worker shares with it fail and are
    fenced at once. With `incarnation`, only rooms made for that process (a restarted worker
    with the same id keeps its new rooms); without, every room of the id."""

    worker_id: str = Field(min_length=1)
    incarnation: str | None = None
    reason: str = "the peer worker died"


class PeerDeadResult(_Message):
    ok: bool = True
    rooms: int  # rooms shared with that process, settled now: open ones fail, all are fenced (repeated: 0)


# ---- /reset_prefix_cache -------------------------------------------------------------------


class CacheReset(_Message):
    """200 from POST /reset_prefix_cache: the prefix cache is forgotten on every rank."""

    ok: bool = True
    forgotten_blocks: int  # cached device blocks nobody held (the host tier's copies went too)


# ---- probes ---------------------------------------------------------------------------------


class Health(_Message):
    """GET /health: 200 when ``status`` is ok, else 503 with the same shape."""

    status: HealthStatus
    role: Role
    step: int
    seconds_since_step: float


class Info(_Message):
    """GET /info."""

    role: Role
    worker_id: str
    model: str              # the served model name
    max_model_len: int
    block_size: int
    num_blocks: int
    tp: int
    eos_token_ids: list[int]
    max_num_seqs: int = 0   # most requests it runs at once (0: not reported); the router's admission
    incarnation: str = ""   # random per process start: a restarted worker with the same worker_id differs
    prefix_salt: str = ""   # hex: where its block names' chains start (POST /cached_prefix); "": no prefix cache


class Load(_Message):
    """GET /load."""

    waiting: int = 0
    running: int = 0
    transferring: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    in_flight: int = 0      # requests whose HTTP call is open here
    rooms_live: int = 0     # transfer rooms not yet terminal
    # the loop's timers summed over its steps with a forward (scheduler/lockstep.py StepTimes)
    step_seconds: dict[str, float] = Field(default_factory=dict)

    @property
    def queued(self) -> int:
        return self.waiting + self.running + self.transferring


# ---- /cached_prefix --------------------------------------------------------------------------


class CachedPrefixQuery(_Message):
    """POST /cached_prefix: the names of a prompt's full blocks, in order, as this worker names
    them (``pdserve.block_names``, started by ``Info.prefix_salt``), each 16 bytes, all in one hex
    string. A router asks before it routes: what other routers sent here is in no index of its own."""

    names: str


class CachedPrefix(_Message):
    """200 from POST /cached_prefix: how many leading blocks of the query the worker holds now,
    in its device pool and, after those, in its host tier, and its load now (what GET /load
    says: the requests other routers sent since this router's last poll count too). A guess for
    routing, not a promise: the worker's loop may evict the blocks before the request comes."""

    device_blocks: int
    host_blocks: int = 0
    load: Load


class Bootstrap(_Message):
    """GET /bootstrap (decode role): one opaque transfer bootstrap blob per TP rank."""

    worker_id: str
    ranks: list[str]


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    request: type[BaseModel] | None
    answers: tuple[type[BaseModel], ...]


ENDPOINTS = (
    Endpoint("GET", "/health", None, (Health,)),
    Endpoint("GET", "/info", None, (Info,)),
    Endpoint("GET", "/load", None, (Load,)),
    Endpoint("GET", "/bootstrap", None, (Bootstrap,)),
    Endpoint("POST", "/generate", GenerateRequest, (RoomLine, Room, TokenLine, TokenLogprob)),
    Endpoint("POST", "/prefill", PrefillRequest, (DecodeTarget, PrefillDone)),
    Endpoint("POST", "/abort", AbortRequest, (AbortResult,)),
    Endpoint("POST", "/peers/dead", PeerDead, (PeerDeadResult,)),
    Endpoint("POST", "/cached_prefix", CachedPrefixQuery, (CachedPrefix,)),
)
