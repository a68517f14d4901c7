"""Every failure the router reports, as an OpenAI error object.

Handlers raise ``APIError`` (or one of its named subclasses); ``error_body`` turns it into
``{"error": {"message", "type", "param", "code"}}``, the shape a client sees, in a plain
response and as the last event of a stream alike. Anthropic's Messages API (/v1/messages) is
answered in its own shape, ``{"type": "error", "error": {"type", "message"}}`` (``body_for``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

RETRY_AFTER_S = 5  # what a 503 (no worker, shutting down) tells the client to wait before a retry


@dataclass
class APIError(Exception):
    """A failure with the HTTP status and OpenAI fields it is reported with."""

    message: str
    status: int = 400
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None   # the Retry-After a 429 or 503 answers with (None: the default)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ANTHROPIC_PATH = "/v1/messages"
# Anthropic's error types by status (529, its own "overloaded", is what a 503 means here)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_body(error: APIError) -> dict[str, Any]:
    """`error` as Anthropic's Messages API reports one (a body, and a stream's `error` event)."""
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def body_for(path: str, error: APIError) -> dict[str, Any]:
    """`error`'s body as the API at `path` writes errors."""
    return anthropic_body(error) if path.startswith(ANTHROPIC_PATH) else error.body()


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request itself is wrong."""
    return APIError(message, 400, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    return APIError(f"The model `{model}` does not exist.", 404, "invalid_request_error", "model",
                    "model_not_found")


def unavailable(message: str) -> APIError:
    """503: no worker can take the request, or a worker died under it."""
    return APIError(message, 503, "server_error", None, "service_unavailable")


def overloaded(message: str, retry_after_s: int) -> APIError:
    """429: no room for the request within the admission queue's bound (admission.py). Type and
    code as OpenAI's own 429 body has them."""
    return APIError(message, 429, "requests", None, "rate_limit_exceeded", retry_after_s)


def internal(message: str) -> APIError:
    return APIError(message, 500, "server_error", None, "internal_error")


def too_large(limit: int) -> APIError:
    return APIError(f"Request body too large: the limit is {limit} bytes.", 413,
                    "invalid_request_error", None, "request_too_large")


def bad_api_key() -> APIError:
    return APIError("Incorrect API key provided.", 401, "authentication_error", None, "invalid_api_key")


def context_too_long(max_len: int, prompt_len: int, max_tokens: int | None, param: str,
                     at_least: bool = False) -> APIError:
    """400 with the numbers, worded as OpenAI words it (`at_least`: a bound from the text's size,
    which was not tokenized)."""
    if at_least:
        msg = (f"This model's maximum context length is {max_len} tokens. However, your request has at "
               f"least {prompt_len} input tokens (by its size). Please reduce the length of the input.")
    elif max_tokens is None or prompt_len >= max_len:
        msg = (f"This model's maximum context length is {max_len} tokens. However, your request has "
               f"{prompt_len} input tokens. Please reduce the length of the input.")
    else:
        msg = (f"This model's maximum context length is {max_len} tokens. However, you requested "
               f"{prompt_len + max_tokens} tokens ({prompt_len} in the {param}, {max_tokens} in the "
               f"completion). Please reduce the length of the {param} or completion.")
    return APIError(msg, 400, "invalid_request_error", param, "context_length_exceeded")


def from_status(status: int, message: str) -> APIError:
    """An HTTP error of the framework (404 path, 405 method, ...) as an error object."""
    if status >= 500:
        return APIError(message, status, "server_error")
    return APIError(message, status, "invalid_request_error")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's error list → (message, param) naming the first bad field.

    A value that matches no member of a union gets one error per member, located under a type
    tag (``stop.str``, ``stop.list[str]``); the tags are dropped and the messages joined.
    """
    if not errors:
        return "Invalid request.", None
    if errors[0].get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    located = [(_field_path(e.get("loc", ())), str(e.get("msg", "invalid value")).removeprefix("Value error, "))
               for e in errors]
    param = located[0][0]
    messages = list(dict.fromkeys(msg for path, msg in located if path == param))
    text = " or ".join(messages)
    others = len({path for path, _ in located if path != param})
    if param:
        text = f"{param}: {text}"
    if others:
        text += f" (and {others} more invalid field{'s' if others > 1 else ''})"
    return text, param or None


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|tuple|literal|function-\w+|json-or-python)\b|[\[(]")


def _field_path(loc: Any) -> str:
    parts: list[str] = []
    for i, p in enumerate(loc):
        if i == 0 and p in ("body", "query", "path"):  # where FastAPI found it: not part of the name
            continue
        if isinstance(p, str) and _TYPE_TAG.search(p):
            break
        parts.append(str(p))
    return ".".join(parts)
