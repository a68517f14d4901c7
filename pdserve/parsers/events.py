"""What a parser tells its caller: text deltas, tool-call pieces, diagnostics and the end.

Events are produced token by token, so the event sequence depends only on the id sequence and
never on how the ids were chunked into ``feed()`` calls (spec P2).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Union


class Diag(str, Enum):
    """Why a diagnostic was recorded. Lenient mode repairs and records; strict mode fails."""

    BARE_DSML = "bare_dsml"
    UNKNOWN_TAG = "unknown_tag"
    UNFINISHED_TAG = "unfinished_tag"
    TAG_OVERFLOW = "tag_overflow"
    VALUE_NOT_JSON = "value_not_json"
    INVALID_JSON_BODY = "invalid_json_body"
    INVALID_CALL = "invalid_call"
    CLOSED_IMPLICITLY = "closed_implicitly"
    REASONING_CLOSED_IMPLICITLY = "reasoning_closed_implicitly"
    IMPLICIT_BLOCK = "implicit_block"
    NO_SEPARATOR = "opener_without_separator"
    TEXT_BETWEEN_TAGS = "text_between_tags"
    TEXT_AFTER_BLOCK = "text_after_block"
    STRAY_THINK = "stray_think"
    STRAY_MARKER = "stray_marker"
    DUPLICATE_PARAMETER = "duplicate_parameter"
    SUPPRESSED = "suppressed"
    MAX_CALLS = "max_calls"
    UNKNOWN_TOOL = "unknown_tool"
    ENDED_INSIDE_BLOCK = "ended_inside_block"
    TRUNCATED_CALL_DROPPED = "truncated_call_dropped"
    CALL_CLOSED_AT_END = "call_closed_at_end"    # the output ended inside a call whose arguments were complete
    VALUE_CONVERTED = "value_converted"          # a string value took its schema type (integer, …)
    VALUE_NOT_CONVERTED = "value_not_converted"  # the schema asked for a type the value cannot take
    ARGUMENTS_UNWRAPPED = "arguments_unwrapped"  # a lone `arguments`/`input` object became the arguments
    MISSING_FENCE = "missing_fence"              # DeepSeek V3: the ```json fence around arguments is off


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    ERROR = "error"  # strict mode met malformed markup; the API turns this into an error object


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int  # counts emitted calls from 0
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgs:
    index: int
    fragment: str  # concatenated per index, the fragments form the OpenAI `arguments` string


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    complete: bool  # False: the stream ended inside the call; nothing was invented to close it


@dataclass(frozen=True, slots=True)
class InvalidCall:
    """A call the model wrote that is not returned as a call (its arguments are not valid JSON,
    or the output ended inside it outside a token-limit cut). Never content: the frontend shows
    it apart (docs/tool-calls.md). `index` is the call's streamed index when its start was
    already sent (clients drop that index), None when nothing of it was sent."""

    index: int | None
    name: str
    text: str    # what the model wrote for it: the arguments so far (Hermes: the raw body)
    reason: str  # the Diag value that explains it


@dataclass(frozen=True, slots=True)
class Diagnostic:
    code: Diag
    detail: str = ""
    fatal: bool = False  # strict mode: the parse failed here and the parser ignores the rest


@dataclass(frozen=True, slots=True)
class Finish:
    reason: FinishReason


Event = Union[ReasoningDelta, ContentDelta, ToolCallStart, ToolCallArgs, ToolCallEnd, InvalidCall, Diagnostic,
              Finish]
