"""The OpenAI request bodies the router accepts (pydantic: the HTTP edge only).

Field bounds follow the OpenAI API reference; the extras vLLM accepts in the body (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``allowed_token_ids``, ``bad_words``,
``cache_salt``, ``priority``, ``return_token_ids``, ``return_tokens_as_token_ids``) are accepted
too, as are SGLang's ``separate_reasoning`` and ``chat_template_kwargs``. Unknown fields are
ignored. Tools are checked for shape here and kept as sent; what they mean for the prompt and the
output is in ``tools``. Checks that need the tokenizer or the context length (token ids, logit-bias ids,
prompt length) are done later, in ``params`` and ``prompts``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from pdserve.frontend.errors import invalid, validation_message

MAX_N = 128
MAX_STOP = 16          # OpenAI documents 4; clients sometimes send a few more
MAX_STOP_LENGTH = 1024
MAX_LOGPROBS = 20
MAX_BAD_WORDS = 128

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: deprecated, read as tool
ToolChoiceName = Literal["none", "auto", "required"]
MAX_TOOL_NAME = 128
# A name is written into the model's markup (DSML `name="…"`, GLM and Hermes text): no quotes,
# angle brackets or white space, which would end it early.
_TOOL_NAME = re.compile(rf'[^\s"<>]{{1,{MAX_TOOL_NAME}}}')


def check_tool(tool: Any, i: int) -> None:
    """One OpenAI function tool: {"type": "function", "function": {"name", "parameters"?, …}}."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError(f"tools[{i}]: only tools of type 'function' are supported")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ValueError(f"tools[{i}]: a function tool needs a 'function' object")
    name = fn.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ValueError(f"tools[{i}]: function.name must be 1-{MAX_TOOL_NAME} characters without white "
                         f"space, quotes or angle brackets, got {name!r}")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"tools[{i}]: function.parameters must be a JSON Schema object")


@dataclass(frozen=True)
class ToolChoice:
    """A chat `tool_choice`, read. `mode`: "none", "auto" or "required". `function`: the function
    it names (exactly one call to it). `allowed` (OpenAI's `allowed_tools`): the only functions the
    model may call, and with "required" must; every tool stays in the prompt, so a conversation
    that narrows its tools from turn to turn keeps its cached prefix."""

    mode: ToolChoiceName
    function: str | None = None
    allowed: tuple[str, ...] | None = None

    @classmethod
    def of(cls, choice: ToolChoiceName | dict[str, Any]) -> ToolChoice:
        """ValueError for a shape other than OpenAI's four."""
        if isinstance(choice, str):
            return cls(choice)
        if choice.get("type") == "function" and (name := _function_name(choice)) is not None:
            return cls("required", function=name)
        body = choice.get("allowed_tools")
        if choice.get("type") == "allowed_tools" and isinstance(body, dict) and isinstance(body.get("tools"), list):
            names = [_function_name(t) if isinstance(t, dict) else None for t in body["tools"]]
            if body.get("mode") in ("auto", "required") and names and None not in names:
                return cls(body["mode"], allowed=tuple(str(n) for n in names))
        raise ValueError('tool_choice must be "none", "auto", "required", {"type": "function", "function": '
                         '{"name": …}} or {"type": "allowed_tools", "allowed_tools": {"mode": "auto" | '
                         '"required", "tools": [{"type": "function", "function": {"name": …}}, …]}}')


def _function_name(choice: dict[str, Any]) -> str | None:
    """The name in {"type": "function", "function": {"name": …}}; None for other shapes."""
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return None
    return str(fn["name"])


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class GenerationFields(BaseModel):
    """What completions and chat completions share: model, n, streaming, sampling, stopping."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)  # 0 (OpenAI allows it): the most likely token only
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extras (vLLM and SGLang accept these in the body).
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False  # the text ends with the stop string (or stop token) it met
    skip_special_tokens: bool = True  # false: special tokens are text too (not the one that ended it)
    allowed_token_ids: list[int] | None = Field(None, min_length=1)  # only these are sampled
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)  # never written (bad_words_ids)
    cache_salt: str | None = Field(None, min_length=1)  # shares cached prefixes only with the same salt
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # lower is sooner (--scheduling-policy priority)
    return_token_ids: bool = False  # the prompt's and each choice's token ids in the answer
    return_tokens_as_token_ids: bool = False  # logprobs name tokens `token_id:<id>`
    # vLLM's structured outputs (pdserve.structured.spec reads them; one constraint per request)
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI marks most fields nullable: a null is the field's default, whatever its type."""
        if not isinstance(data, dict):
            return data
        defaulted = {name for name, f in cls.model_fields.items() if not f.is_required() and f.default is not None}
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(items)}")
        if any(len(s) > MAX_STOP_LENGTH for s in items):
            raise ValueError(f"a stop sequence may be at most {MAX_STOP_LENGTH} characters long")
        return v

    @field_validator("bad_words")
    @classmethod
    def _words(cls, v: list[str] | None) -> list[str] | None:
        if any(not w.strip() for w in v or ()):
            raise ValueError("bad words must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias}")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> GenerationFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(GenerationFields):
    # null (OpenAI's default, "<|endoftext|>"): generate as from the start of a new document
    prompt: str | list[str] | list[int] | list[list[int]] | None
    max_tokens: int | None = Field(16, ge=0)  # 0: no output, the prompt scored (with echo and logprobs)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and any(isinstance(p, list) and not p for p in v):
            raise ValueError("a token-id prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it may only equal n)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


# The roles whose messages define these fields in the OpenAI API. On another role's message the
# key is an extra one, where any JSON value is valid: one that does not fit the field is dropped.
FIELD_ROLES: dict[str, frozenset[str]] = {
    "name": frozenset({"system", "developer", "user", "assistant", "function"}),
    "tool_calls": frozenset({"assistant"}),
    "tool_call_id": frozenset({"tool"}),
}


def _fits(field: str, value: Any) -> bool:
    if value is None:
        return True
    if field == "tool_calls":
        return isinstance(value, list) and all(isinstance(call, dict) for call in value)
    return isinstance(value, str)


class ChatMessage(BaseModel):
    """One message; extra keys are kept because chat templates may read them."""

    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _foreign_fields(cls, data: Any) -> Any:
        """Drop a field the message's role does not define (FIELD_ROLES) when its value does not
        fit the field: a user message's `tool_calls: 5` is an unknown extra key, not an error."""
        if not isinstance(data, dict):
            return data
        role = data.get("role")
        foreign = {k for k, roles in FIELD_ROLES.items()
                   if k in data and role not in roles and not _fits(k, data[k])}
        return {k: v for k, v in data.items() if k not in foreign} if foreign else data

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for part in v if isinstance(v, list) else ():
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"only text content parts are supported, got type {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
        return v

    def text(self) -> str:
        """The content as one string (text parts joined), as string-content templates expect."""
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""


# Chat fields whose mere presence asks for what pdserve does not do, and what it says instead.
_UNSUPPORTED = {"audio": "audio output is not supported",
                "web_search_options": "web search is not supported: search in the client and send the results"}


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions; also what a Responses or Messages request becomes (`converted`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Tool calling (see ``tools``): the dicts are kept as sent, since templates render them.
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceName | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None: true
    separate_reasoning: bool = True          # false: reasoning text is part of `content`
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's, and DeepSeek's "max": the template's `reasoning_effort` unless chat_template_kwargs set it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # Asked for to be refused, not ignored: audio output, web search, and the function calling that
    # tools replaced
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    @classmethod
    def converted(cls, fields: dict[str, Any], names: dict[str, str]) -> ChatCompletionRequest:
        """The chat request another API's request becomes (`fields`: chat fields, None ones left
        out); its 400 names the field as that API calls it (`names`: chat name → its name)."""
        try:
            return cls.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            message, param = validation_message(e.errors(include_url=False))
            if param in names:
                message, param = names[param] + message.removeprefix(param), names[param]
            raise invalid(message, param) from None

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(v or ()):
            check_tool(tool, i)
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and set(v) - {"text"}:
            raise ValueError(f"only text output is supported, got modalities {v}")
        return v

    @field_validator("audio", "web_search_options")
    @classmethod
    def _unsupported(cls, v: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        if v is not None:
            raise ValueError(_UNSUPPORTED[info.field_name or ""])
        return v

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, v: Any) -> Any:
        if v not in (None, [], "none", "auto"):  # what a client sends with no functions changes nothing
            raise ValueError("functions and function_call (deprecated by OpenAI) are not supported: "
                             "send tools and tool_choice")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: ToolChoiceName | dict[str, Any] | None) -> ToolChoiceName | dict[str, Any] | None:
        if isinstance(v, dict):
            ToolChoice.of(v)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        self._check_tool_choice()
        return self

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return
        names = [t["function"]["name"] for t in self.tools or ()]
        read = ToolChoice.of(choice)
        if not names:
            shown = choice if isinstance(choice, str) else "a named function" if read.function else "allowed_tools"
            raise ValueError(f"tool_choice {shown!r} needs a non-empty tools list")
        unknown = [n for n in read.allowed or (read.function,) if n is not None and n not in names]
        if unknown:
            raise ValueError(f"tool_choice names function {unknown[0]!r}, which is not in tools ({', '.join(names)})")

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """POST /tokenize (as vLLM has it): a `prompt`, or chat `messages` through the chat template
    exactly as /v1/chat/completions would render them."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (in the template)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids → text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for logprobs
# `include` values that change nothing here: the tools they are about are refused, and reasoning
# items carry their text, never encrypted content (Codex asks for it with every request)
RESPONSES_INCLUDE_NOOP = frozenset({
    "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "message.input_image.image_url"})


class ResponsesRequest(BaseModel):
    """POST /v1/responses: OpenAI's Responses API. A turn sends the whole conversation in `input`
    (messages, the model's function calls and their outputs), or continues a stored response
    (`previous_response_id`, response_store.py); `conversation` objects are refused. The items and
    tools are checked and turned into a chat request in ``responses``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # not OpenAI's: reproducible sampling
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceName | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", …}}
    reasoning: dict[str, Any] | None = None  # its `effort` is chat's reasoning_effort; the rest changes nothing
    stream: bool = False
    store: bool | None = None  # None or true: kept for previous_response_id (response_store.py)
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None  # auto: the earliest turns go when it does not fit
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None  # a prompt template stored at OpenAI: refused
    include: list[str] | None = None  # "message.output_text.logprobs": the text's tokens' logprobs
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives to each of those
    cache_salt: str | None = None  # vLLM's, as on chat
    priority: int = 0              # vLLM's, as on chat

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        if self.conversation is not None:
            raise ValueError("conversations are not supported: send the whole conversation in input, or "
                             "continue a stored response with previous_response_id")
        if self.background:
            raise ValueError("background responses are not supported")
        if self.prompt is not None:
            raise ValueError("prompt templates are not supported: send the instructions and input")
        unknown = [v for v in self.include or () if v not in RESPONSES_INCLUDE_NOOP and v != OUTPUT_LOGPROBS]
        if unknown:
            raise ValueError(f"unknown include value(s): {', '.join(map(repr, unknown))}")
        if isinstance(self.input, str) and not self.input:
            raise ValueError("input must not be empty")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be an empty list")
        return self

    @property
    def output_logprobs(self) -> int | None:
        """None: no logprobs; N: each output text token's logprob and its N most likely
        alternatives (`top_logprobs` counts only with the include, as OpenAI's)."""
        return (self.top_logprobs or 0) if OUTPUT_LOGPROBS in (self.include or ()) else None


class MessagesRequest(BaseModel):
    """POST /v1/messages: Anthropic's Messages API. The blocks and tools are checked and turned
    into a chat request in ``messages``; `thinking` switches the template's reasoning on or off and
    `output_config.effort` is its reasoning effort; `metadata` and cache-control marks are accepted
    and change nothing (the prefix cache needs no marks). The current `anthropic` SDK sends `temperature`, `top_p`
    and `top_k` only in `extra_body`, as it would pdserve's `cache_salt` and `priority`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema"}}; effort: unused
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None  # the MCP connector: refused (servers pdserve does not run)
    cache_salt: str | None = None  # vLLM's, as on chat (in the SDK's `extra_body`)
    priority: int = 0              # vLLM's, as on chat


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: a Messages request's prompt size, without generating."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
