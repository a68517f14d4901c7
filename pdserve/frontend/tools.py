"""Tool calling at the router: what a chat request's `tools`, `tool_choice`,
`parallel_tool_calls` and `separate_reasoning` mean for the prompt, the output parser and the
end of a choice.

* The parser runs for every chat request of a model with a profile. Calls are shown (tools
  mode EMIT) only when the request has tools and `tool_choice` is not "none"; otherwise they
  are parsed and swallowed (SUPPRESS), so markup never reaches `content`.
* `tool_choice: "none"` also leaves the tools out of the prompt, so the model answers in text.
* `"required"` and a named function are enforced by validation, not constrained decoding:
  when the model ends on its own (finish reason "stop") without a complete call, the choice
  fails with a 500 error object (`code: "tool_choice_not_satisfied"`), in a stream as its last
  event. A choice cut by `max_tokens` is answered as it is, with finish reason "length". With a
  named function, calls to other functions are swallowed (the message names them).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.frontend.errors import APIError
from pdserve.frontend.protocol import ChatCompletionRequest, named_function
from pdserve.parsers import ParamSchema, Profile, ToolsMode, prompt_opens_reasoning, tool_schemas
from pdserve.parsers.options import ParserOptions


@dataclass(frozen=True)
class ToolPolicy:
    prompt_tools: list[dict[str, Any]] | None  # what the prompt renders (None: no tools section)
    emit: bool                 # calls are shown to the client
    required: bool             # the choice must end with at least one complete call
    function: str | None       # tool_choice named this function
    parallel: bool
    separate_reasoning: bool
    # The request's parameter schemas: string values the model wrote take their schema's type.
    schemas: dict[str, dict[str, ParamSchema]] = field(default_factory=dict)

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> ToolPolicy:
        tools = list(req.tools or [])
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        emit = bool(tools) and choice != "none"
        function = named_function(choice) if isinstance(choice, dict) else None
        return cls(prompt_tools=tools if emit else None, emit=emit,
                   required=choice == "required" or function is not None, function=function,
                   parallel=req.parallel_tool_calls is not False, separate_reasoning=req.separate_reasoning,
                   schemas=tool_schemas(tools) if emit else {})

    def parser_options(self, profile: Profile, prompt_ids: Sequence[int], stop_ids: frozenset[int],
                       call_id_prefix: str) -> ParserOptions:
        return ParserOptions(
            tools_mode=ToolsMode.EMIT if self.emit else ToolsMode.SUPPRESS,
            parallel_tool_calls=self.parallel,
            separate_reasoning=self.separate_reasoning,
            start_in_reasoning=prompt_opens_reasoning(profile, prompt_ids),
            call_id_prefix=call_id_prefix,
            stop_ids=stop_ids,
            known_tools=frozenset([self.function]) if self.function is not None else None,
            drop_unknown_tools=self.function is not None,
            schemas=self.schemas,
        )

    def check(self, finish_reason: str, complete_calls: int, swallowed: Sequence[str]) -> None:
        """At the end of a choice: raise the error object when tool_choice was not satisfied."""
        if not self.required or finish_reason != "stop" or complete_calls:
            return
        wanted = f"function {self.function!r}" if self.function else "a tool"
        choice = f'{{"type": "function", "function": {{"name": "{self.function}"}}}}' if self.function \
            else '"required"'
        other = f" (it called {', '.join(repr(n) for n in swallowed)} instead)" if swallowed else ""
        raise APIError(f"tool_choice {choice} was not satisfied: the model finished without calling {wanted}"
                       f"{other}. pdserve checks tool_choice after generation and does not constrain "
                       "decoding; retry, or use tool_choice \"auto\".",
                       500, "server_error", "tool_choice", "tool_choice_not_satisfied")
