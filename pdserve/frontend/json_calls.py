"""Tool calls of a model without a call syntax of its own, written as grammar-constrained JSON.

With ``tool_choice`` "required" or a named function, the router constrains such a model's
output to ``{"name": …, "arguments": {…}}`` (a list of them for parallel "required" calls;
``pdserve.structured.spec.tool_call_schema``). This decoder reads that JSON back and answers
it as OpenAI does: ``tool_calls`` with ``finish_reason`` "tool_calls", streamed or not. The
calls are sent when the output is complete (a partial JSON call is not a call). An output cut
by ``max_tokens`` before the JSON closed is returned as content, with finish reason "length".
"""
from __future__ import annotations

import json
import secrets

from pdserve.frontend.output import OutputDelta
from pdserve.parsers import ToolCallArgs, ToolCallEnd, ToolCallStart
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer


class JsonCallDecoder:
    """An ``OutputDecoder`` (frontend/output.py) for grammar-constrained JSON calls."""

    stopped = False  # stop strings do not apply inside a call

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._text = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self._pieces: list[str] = []
        self.finish_reason: str | None = None

    def push(self, token_id: int) -> OutputDelta:
        self._pieces.append(self._text.push(token_id))
        return OutputDelta()

    def finish(self, reason: str = "stop") -> OutputDelta:
        self._pieces.append(self._text.flush())
        text = "".join(self._pieces)
        try:
            doc = json.loads(text)
            calls = [(str(c["name"]), json.dumps(c["arguments"], ensure_ascii=False))
                     for c in (doc if isinstance(doc, list) else [doc])]
        except (ValueError, TypeError, KeyError):  # cut by max_tokens before the JSON closed
            self.finish_reason = reason
            return OutputDelta(text)
        parts: list = []
        for i, (name, arguments) in enumerate(calls):
            parts += [ToolCallStart(i, f"call_{secrets.token_hex(12)}", name), ToolCallArgs(i, arguments),
                      ToolCallEnd(i, True)]
        self.finish_reason = "tool_calls"
        return OutputDelta(parts=parts)
