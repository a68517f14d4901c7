"""Token-id-level output parsers: reasoning, tool calls (DSML, GLM, Hermes), plain content.

Start-up: ``profile = resolve_profile(vocab, model_type, chat_template, override)`` (override: a
name from ``PARSER_NAMES``, the ``--tool-call-parser`` flag). Per request:
``parser = make_parser(profile, ParserOptions(..., schemas=tool_schemas(request.tools)))``, then
``parser.feed(ids)`` for each batch of decoded ids and ``parser.finish(length=...)`` at the end;
``aggregate(events)`` folds the events into the non-streaming message (docs/tool-calls.md).
"""
from __future__ import annotations

from pdserve.parsers.aggregate import Aggregate, CallResult, aggregate, coalesce
from pdserve.parsers.base import Pending, StreamParser
from pdserve.parsers.events import (ContentDelta, Diag, Diagnostic, Event, Finish, FinishReason, InvalidCall,
                                    ReasoningDelta, ToolCallArgs, ToolCallEnd, ToolCallStart)
from pdserve.parsers.factory import make_parser
from pdserve.parsers.options import (Emission, ParamSchema, ParserOptions, ToolsMode, param_types_from_tools,
                                     tool_schemas)
from pdserve.parsers.profiles import (PARSER_NAMES, Format, Profile, ProfileError, prompt_opens_reasoning,
                                      resolve_profile)
from pdserve.parsers.vocab import TokenizerVocab, Vocab

__all__ = [
    "Aggregate", "CallResult", "ContentDelta", "Diag", "Diagnostic", "Emission", "Event", "Finish",
    "FinishReason", "Format", "InvalidCall", "PARSER_NAMES", "ParamSchema", "ParserOptions", "Pending", "Profile",
    "ProfileError", "ReasoningDelta",
    "StreamParser", "TokenizerVocab", "ToolCallArgs", "ToolCallEnd", "ToolCallStart", "ToolsMode", "Vocab",
    "aggregate", "coalesce", "make_parser", "param_types_from_tools", "prompt_opens_reasoning",
    "resolve_profile", "tool_schemas",
]
