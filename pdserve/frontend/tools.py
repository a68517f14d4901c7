"""Tool calling at the router: what a chat request's `tools`, `tool_choice`,
`parallel_tool_calls` and `separate_reasoning` mean for the prompt, the output parser and the
end of a choice.

* The parser runs for every chat request of a model with a profile. Calls are shown (tools
  mode EMIT) only when the request has tools and `tool_choice` is not "none"; otherwise they
  are parsed and swallowed (SUPPRESS), so markup never reaches `content`.
* `tool_choice: "none"` also leaves the tools out of the prompt, so the model answers in text.
* A named function or `allowed_tools` narrows the calls to those functions (`callable_tools`:
  the grammar's, and the parser drops calls to others) but not the prompt, which shows every
  tool: a conversation that narrows its tools keeps its cached prefix.
* `"required"` and a named function are enforced by grammar-constrained decoding:
  * on a model with a call syntax of its own (DSML, DeepSeek V3/V3.1, GLM, Hermes), by a
    grammar of that syntax (`pdserve.structured.tool_grammars`) whose arguments follow the
    tools' schemas; the model's parser reads the output as always. The grammar starts after
    the reasoning section when the prompt opens one; when the prompt leaves reasoning to the
    model (no think marker at its end), one reasoning block may come first.
  * on a model without one (the default model), as a JSON call `{"name", "arguments"}` (or a
    list of them) that `json_calls` answers as `tool_calls`.
  `strict: true` on the tools makes unsupported schema keywords a 400 instead of ignored.
* `"auto"` with every tool `strict: true`, on a model with a call syntax: free text (reasoning
  markers included), and any call the model writes follows its tool's schema from its marker
  on. Otherwise "auto" is not constrained.
* `"auto"` with a JSON `response_format` (an agent with tools and a typed final answer): the
  model calls tools, or answers in the format. `response_format` shapes the text answer, as
  at OpenAI, so the grammar is the union of the calls and the answer; on a model without a
  call syntax, of a JSON call document and the answer (`json_calls.CallOrAnswerDecoder` tells
  them apart by the document's opening). With `"required"` or a named function the calls
  leave no text answer, and `response_format` is set aside.
* A `"required"` choice that still ends without a complete call (a reasoning section the
  model never closed) fails with a 500 error object (`code: "tool_choice_not_satisfied"`); one
  cut by `max_tokens` is answered as it is, with finish reason "length".

`output_constraint` gathers a request's one output constraint (response_format, vLLM's
structured_outputs, or the tool-call grammar) and compiles it here, off the event loop, so a
bad schema is a 400 naming its field before anything reaches a worker.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.frontend.errors import APIError, invalid
from pdserve.frontend.protocol import ChatCompletionRequest, GenerationFields, ToolChoice
from pdserve.parsers import Format, ParamSchema, Profile, ToolsMode, prompt_opens_reasoning, tool_schemas
from pdserve.parsers.options import ParserOptions
from pdserve.structured import GrammarKind, GrammarObserver, Grammars, GrammarSpec
from pdserve.structured.factory import grammars_for_tokenizer
from pdserve.structured.tool_grammars import ToolGrammarError, call_syntax_grammar
from pdserve.structured.spec import (GUIDED_FIELDS, SpecError, from_response_format, from_vllm, tool_call_schema,
                                     tools_strict)
from pdserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolPolicy:
    prompt_tools: list[dict[str, Any]] | None  # what the prompt renders (None: no tools section)
    emit: bool                 # calls are shown to the client
    required: bool             # the choice must end with at least one complete call
    function: str | None       # tool_choice named this function
    allowed: frozenset[str] | None  # the only functions the model may call (named, or allowed_tools)
    parallel: bool
    separate_reasoning: bool
    # The request's parameter schemas: string values the model wrote take their schema's type.
    schemas: dict[str, dict[str, ParamSchema]] = field(default_factory=dict)
    # "auto" with a JSON response_format: the format a text answer takes instead of calls
    answer: GrammarSpec | None = None

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> ToolPolicy:
        tools = list(req.tools or [])
        choice = ToolChoice.of(req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none"))
        emit = bool(tools) and choice.mode != "none"
        function = choice.function
        required = choice.mode == "required"
        narrowed = choice.allowed or ((function,) if function else ())
        answer = None
        if emit and not required:
            try:
                answer = from_response_format(req.response_format)
            except SpecError:  # output_constraint answers it with a 400
                pass
        return cls(prompt_tools=tools if emit else None, emit=emit, required=required, function=function,
                   allowed=frozenset(narrowed) if narrowed else None, parallel=req.parallel_tool_calls is not False,
                   separate_reasoning=req.separate_reasoning, schemas=tool_schemas(tools) if emit else {},
                   answer=answer)

    def call_grammar(self, profile: Profile, model_opens_reasoning: bool = False) -> GrammarSpec | None:
        """The grammar enforcing `"required"` or a named function: the model's own call syntax,
        or JSON calls for a model without one; for "auto" with a JSON response_format, those
        calls or the answer in that format; for "auto" with every tool `strict`, on a model
        with a call syntax, free text whose calls follow their schemas. None when nothing is
        enforced. A 400 naming tool_choice when the tools cannot be written in the model's
        syntax."""
        tools = self.callable_tools
        if not tools:
            return None
        strict = tools_strict(tools, self.function)
        # "auto" without a response_format: a call is optional; with every tool strict, calls in
        # the model's own syntax are still held to their schemas (free text around them)
        optional = not self.required and self.answer is None
        if optional and (not strict or profile.format is Format.PLAIN):
            return None
        if profile.format is Format.PLAIN:
            schema = tool_call_schema(tools, self.function, self.parallel)
            if self.answer is not None:
                schema = {"anyOf": [schema, json.loads(self.answer.value)]}
                strict = strict and self.answer.strict
            return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")), strict=strict)
        try:
            lark = call_syntax_grammar(profile, tools, self.function, self.parallel,
                                       model_opens_reasoning, optional, self.answer)
        except ToolGrammarError as e:
            raise invalid(f"tool_choice cannot be enforced in {profile.name}'s tool-call syntax: {e}",
                          "tool_choice") from None
        return GrammarSpec(GrammarKind.GRAMMAR, lark, strict=strict)

    @property
    def callable_tools(self) -> list[dict[str, Any]]:
        """The tools the model may call: the prompt's, narrowed by a named function or allowed_tools."""
        return [t for t in self.prompt_tools or () if self.allowed is None or t["function"]["name"] in self.allowed]

    def parser_options(self, profile: Profile, prompt_ids: Sequence[int], stop_ids: frozenset[int],
                       call_id_prefix: str) -> ParserOptions:
        return ParserOptions(
            tools_mode=ToolsMode.EMIT if self.emit else ToolsMode.SUPPRESS,
            parallel_tool_calls=self.parallel,
            separate_reasoning=self.separate_reasoning,
            start_in_reasoning=prompt_opens_reasoning(profile, prompt_ids),
            call_id_prefix=call_id_prefix,
            stop_ids=stop_ids,
            known_tools=self.allowed,
            drop_unknown_tools=self.allowed is not None,
            schemas=self.schemas,
        )

    def check(self, finish_reason: str, complete_calls: int, swallowed: Sequence[str]) -> None:
        """At the end of a choice: raise the error object when tool_choice was not satisfied."""
        if not self.required or finish_reason != "stop" or complete_calls:
            return
        if self.function:
            wanted = f"function {self.function!r}"
            choice = f'{{"type": "function", "function": {{"name": "{self.function}"}}}}'
        elif self.allowed:
            wanted, choice = f"one of {', '.join(map(repr, sorted(self.allowed)))}", '{"type": "allowed_tools", …}'
        else:
            wanted, choice = "a tool", '"required"'
        other = f" (it called {', '.join(repr(n) for n in swallowed)} instead)" if swallowed else ""
        raise APIError(f"tool_choice {choice} was not satisfied: the model finished without calling {wanted}"
                       f"{other}: the output ended before the calls the grammar enforces (a reasoning section "
                       "the model did not close); retry, or use tool_choice \"auto\".",
                       500, "server_error", "tool_choice", "tool_choice_not_satisfied")


# ---- the output constraint ----------------------------------------------------------------------

_GRAMMARS: weakref.WeakKeyDictionary[Tokenizer, Grammars] = weakref.WeakKeyDictionary()


def router_grammars(tokenizer: Tokenizer, observer: GrammarObserver | None = None) -> Grammars:
    """The router's grammar cache of `tokenizer` (one per tokenizer, kept as long as it lives)."""
    grammars = _GRAMMARS.get(tokenizer)
    if grammars is None:
        grammars = _GRAMMARS[tokenizer] = grammars_for_tokenizer(tokenizer)
    if observer is not None:
        grammars.observer = observer
    return grammars


def output_constraint(req: GenerationFields, policy: ToolPolicy | None, profile: Profile
                      ) -> tuple[GrammarSpec, str] | None:
    """The request's one output constraint and the field it came from; 400 when malformed or
    when more than one field asks for one. `profile`: the model's output grammar (its call
    syntax, if any, is what tool_choice is enforced in)."""
    found: list[tuple[GrammarSpec, str]] = []
    try:
        rf = from_response_format(getattr(req, "response_format", None))
        if rf is not None:
            found.append((rf, "response_format"))
        guided = {k: getattr(req, k) for k in GUIDED_FIELDS if getattr(req, k, None) is not None}
        extra = from_vllm(getattr(req, "structured_outputs", None), guided)
        if extra is not None:
            found.append((extra, "structured_outputs" if req.structured_outputs is not None else next(iter(guided))))
    except SpecError as e:
        raise invalid(str(e), e.param) from None
    calls = policy.call_grammar(profile) if policy is not None else None
    if calls is not None and policy is not None:
        if policy.required or policy.answer is not None:
            # response_format shapes a text answer: forced calls leave none, and "auto"'s
            # grammar already holds the answer's format
            found = [f for f in found if f[1] != "response_format"]
        if policy.required or policy.answer is not None or not found:
            found.append((calls, "tools"))  # "auto"'s optional calls give way to structured_outputs
    if len(found) > 1:
        raise invalid(f"only one output constraint per request: {' and '.join(p for _, p in found)} both ask "
                      "for one", found[1][1])
    return found[0] if found else None


async def check_constraint(grammars: Grammars, spec: GrammarSpec, param: str) -> None:
    """Compile `spec` (cached) in a thread; a 400 naming `param` with the reason when it fails."""
    why = await asyncio.to_thread(grammars.check, spec)
    if why is not None:
        what = "the tools' parameters" if param == "tools" else param
        raise invalid(f"{what} cannot be enforced: {why}", param)


def json_calls(field: str, profile: Profile) -> bool:
    """The constraint is the JSON-call grammar of a model without a call syntax: its output is
    read back by ``JsonCallDecoder``, not by the model's parser."""
    return field == "tools" and profile.format is Format.PLAIN


def for_prompt(constraint: tuple[GrammarSpec, str], policy: ToolPolicy, profile: Profile,
               prompt_ids: Sequence[int]) -> GrammarSpec:
    """The constraint as this prompt's output takes it. JSON calls are read as raw text: their
    grammar starts at once. Anything else starts after the reasoning section when the prompt
    opens one; a call-syntax grammar lets the model open one itself when the prompt leaves it
    to the model (no think marker at its end, as Qwen3 in thinking mode)."""
    spec, field = constraint
    if json_calls(field, profile):
        return spec
    if field == "tools" and profile.think is not None and leaves_reasoning_to_model(profile, prompt_ids):
        grammar = policy.call_grammar(profile, model_opens_reasoning=True)
        assert grammar is not None
        return grammar
    return after_reasoning(spec, profile, prompt_ids)


def leaves_reasoning_to_model(profile: Profile, prompt_ids: Sequence[int]) -> bool:
    """The prompt's last non-blank token is no think marker (neither opens nor closes reasoning)."""
    if profile.think is None:
        return False
    for token_id in reversed(prompt_ids):
        if profile.vocab.token_bytes(token_id).strip() != b"":
            return token_id not in (profile.think.start, profile.think.end)
    return True


def after_reasoning(spec: GrammarSpec, profile: Profile, prompt_ids: Sequence[int]) -> GrammarSpec:
    """When the prompt opens a reasoning section, the output's grammar starts after it ends."""
    if profile.think is None or not prompt_opens_reasoning(profile, prompt_ids):
        return spec
    return dataclasses.replace(spec, start_after=profile.think.end)
