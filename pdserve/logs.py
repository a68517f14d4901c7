"""Process logging: plain text, or one JSON object per line (`--log-json`), on stderr.

Every record made while a request is being served carries its X-Request-Id: the router's
middleware sets `REQUEST_ID` for the request's task, and tasks it starts (choices, aborts)
inherit it, so no log call has to pass the id along; the worker's API does the same with the
X-Request-Id the router sends (the room id). Code outside a request's context (the scheduler
thread, transfer agents, TP ranks) passes ``extra=about(id)``. Text lines get it as a ``[id]``
prefix (unless the message names it already); JSON lines as ``request_id``.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from typing import Any

REQUEST_ID: ContextVar[str | None] = ContextVar("pdserve_request_id", default=None)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Extra fields a log call may pass (`extra={"http": {...}}`) that JSON lines keep as they are.
EXTRA_FIELDS = ("http",)


class RequestIdFilter(logging.Filter):
    """Stamps each record with the request id of the context it was made in (or None)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self, fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        rid = getattr(record, "request_id", None)
        if rid and rid not in record.message:
            record.message = f"[{rid}] {record.message}"
        return super().formatMessage(record)


class JSONFormatter(logging.Formatter):
    """``{"ts", "level", "component", "logger", "message", "request_id"?, "http"?, "exc"?}``."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "component": self.component, "logger": record.name,
            "message": record.getMessage()}
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        for name in EXTRA_FIELDS:
            if name in record.__dict__:
                out[name] = record.__dict__[name]
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def about(request_id: str) -> dict[str, str]:
    """`extra=` of a log call about one request (or its room: same id) made where no request
    context is set (the scheduler thread, a TP rank), so the record carries the id all the same."""
    return {"request_id": request_id}


def setup_logging(json_logs: bool, component: str, level: int | str | None = None,
                  text_format: str = TEXT_FORMAT) -> None:
    """One stderr handler on the root logger (replacing any), text or JSON. `level`: keep the
    root logger's when None. Libraries' loggers (uvicorn, httpx) propagate to it."""
    root = logging.getLogger()
    if level is not None:
        root.setLevel(level.upper() if isinstance(level, str) else level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter(component) if json_logs else TextFormatter(text_format))
    handler.addFilter(RequestIdFilter())
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
