"""Output token ids → deltas for the client: the one hook between decode workers and responses.

Every generated token of a choice goes through an ``OutputDecoder`` one id at a time, so the
output never depends on how the workers or the stream batching chunked the ids.

* Chat, for a model with an output profile (``ChatOutput``, resolved once at start-up): the
  token-ID parser (``pdserve.parsers``). Its events (reasoning, content, tool-call pieces) are
  the delta, in order; stop strings cut the content. See ``tools`` for the request policy.
* Completions, and chat for a model without a profile and without think markers: plain text
  (special tokens skipped unless the request says ``skip_special_tokens: false``, stop strings
  cut by ``TextStream``, the stop token that ended the output left out as vLLM does).
"""
from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Union

from pdserve.frontend.prompts import PromptStyle
from pdserve.frontend.tools import ToolPolicy
from pdserve.parsers import (ContentDelta, Diag, Diagnostic, Event, Finish, FinishReason, Format, InvalidCall,
                             Profile, ReasoningDelta, StreamParser, ToolCallArgs, ToolCallEnd, ToolCallStart,
                             ProfileError, make_parser, resolve_profile)
from pdserve.textstream import StopStrings, TextStream
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# What a delta is made of: the parser's text and tool-call events, in the order they happened
# (InvalidCall: a call the model wrote that is reported apart, never returned as a call).
Part = Union[ContentDelta, ReasoningDelta, ToolCallStart, ToolCallArgs, ToolCallEnd, InvalidCall]
_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.TOOL_CALLS: "tool_calls",
            FinishReason.ERROR: "stop"}


class OutputDelta:
    """What one or more tokens added to a choice's message: content, reasoning and tool-call
    pieces in order (``OutputDelta("text")`` is plain content)."""

    __slots__ = ("parts",)

    def __init__(self, content: str = "", parts: Iterable[Part] = ()) -> None:
        self.parts: list[Part] = [ContentDelta(content)] if content else []
        self.parts.extend(parts)

    def __bool__(self) -> bool:
        return bool(self.parts)

    def __repr__(self) -> str:
        return f"OutputDelta({self.parts!r})"

    @property
    def content(self) -> str:
        return "".join(p.text for p in self.parts if isinstance(p, ContentDelta))

    def extend(self, other: OutputDelta) -> None:
        self.parts.extend(other.parts)

    def merge(self, other: OutputDelta) -> OutputDelta:
        return OutputDelta(parts=[*self.parts, *other.parts])


class OutputDecoder(Protocol):
    stopped: bool               # a stop condition was met inside the text (the workers must be told)
    stop_sequence: str | None   # the stop string that ended it, if one did
    finish_reason: str | None   # set by finish(): the choice's finish reason

    def push(self, token_id: int) -> OutputDelta: ...

    def finish(self, reason: str = "stop") -> OutputDelta:
        """The end (`reason`: what the worker said, "stop" or "length"); may raise APIError."""
        ...


class TextDecoder:
    """Plain text: special tokens are skipped (unless not `skip_special_tokens`), stop strings cut
    (never sent, not even in part, unless `include_stop`).

    As in vLLM, the token that ended the output (one of `ends`: EOS or a stop_token_ids entry)
    is not text unless `include_stop`. A token of `ends` is therefore held until the next one
    shows it did not end the output (EOS under ignore_eos), or until `finish` says how it ended."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str], include_stop: bool = False,
                 ends: Iterable[int] = (), skip_special_tokens: bool = True) -> None:
        self._text = TextStream(tokenizer, stop, skip_special_tokens=skip_special_tokens, include_stop=include_stop)
        self._ends = frozenset(ends)
        self._include_stop = include_stop
        self._held: int | None = None  # a token of `ends`, not yet known to be the last
        self.finish_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self._text.stopped

    @property
    def stop_sequence(self) -> str | None:
        return self._text.stop_sequence

    def push(self, token_id: int) -> OutputDelta:
        ids = [] if self._held is None else [self._held]
        self._held = None
        if token_id in self._ends:
            self._held = token_id
        else:
            ids.append(token_id)
        return OutputDelta(self._text.push(ids) if ids else "")

    def finish(self, reason: str = "stop") -> OutputDelta:
        self.finish_reason = reason
        text = ""
        if self._held is not None and (reason != "stop" or self._include_stop):
            text = self._text.push([self._held])
        self._held = None
        return OutputDelta(text + self._text.flush())


class ParsedDecoder:
    """A chat choice through the token-ID parser; stop strings apply to its content."""

    def __init__(self, parser: StreamParser, stop: list[str], policy: ToolPolicy | None = None,
                 on_diagnostic: Callable[[str], None] | None = None, include_stop: bool = False) -> None:
        self._parser = parser
        self._stops = StopStrings(stop, include_stop)
        self._policy = policy
        self._on_diagnostic = on_diagnostic
        self._parser_reason: FinishReason | None = None
        self.complete_calls = 0
        self.swallowed: list[str] = []   # calls to other functions than a named tool_choice
        self.finish_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def stop_sequence(self) -> str | None:
        return self._stops.matched

    def push(self, token_id: int) -> OutputDelta:
        if self.stopped:
            return OutputDelta()
        return self._deliver(self._parser.feed((token_id,)))

    def finish(self, reason: str = "stop") -> OutputDelta:
        delta = OutputDelta()
        if not self.stopped:
            delta = self._deliver(self._parser.finish(length=reason == "length"))
            if not self.stopped:
                delta.extend(OutputDelta(self._stops.release()))
        if self.stopped:
            self.finish_reason = "tool_calls" if self.complete_calls else "stop"
        elif self._parser_reason is not None:
            self.finish_reason = _REASONS[self._parser_reason]
        else:
            self.finish_reason = reason
        if self._policy is not None:
            self._policy.check(self.finish_reason, self.complete_calls, self.swallowed)
        return delta

    def _deliver(self, events: Iterable[Event]) -> OutputDelta:
        out = OutputDelta()
        for ev in events:
            if isinstance(ev, ContentDelta):
                text = self._stops.push(ev.text)
                if text:
                    out.parts.append(ContentDelta(text))
                if self._stops.stopped:
                    break
            elif isinstance(ev, Diagnostic):
                self._diagnostic(ev)
            elif isinstance(ev, Finish):
                self._parser_reason = ev.reason
            else:
                held = self._stops.release()  # a stop string cannot span a call or reasoning
                if held:
                    out.parts.append(ContentDelta(held))
                out.parts.append(ev)
                if isinstance(ev, ToolCallEnd) and ev.complete:
                    self.complete_calls += 1
        return out

    def _diagnostic(self, ev: Diagnostic) -> None:
        logger.debug("parser diagnostic %s %s", ev.code.value, ev.detail)
        if ev.code is Diag.UNKNOWN_TOOL:  # a call to another function than tool_choice named
            self.swallowed.append(ev.detail)
        if self._on_diagnostic is not None:
            self._on_diagnostic(ev.code.value)


@dataclass
class ChatOutput:
    """The model's output grammar, resolved once at start-up, and the chat decoders it makes."""

    profile: Profile
    tokenizer: Tokenizer
    on_diagnostic: Callable[[str], None] | None = None  # metrics: called with each diagnostic's kind

    @classmethod
    def load(cls, model_dir: Path, tokenizer: Tokenizer, override: str | None = None) -> ChatOutput:
        """Raises ``pdserve.parsers.ProfileError`` when a marker the grammar needs as one token
        is not one in this tokenizer, or `override` (``--tool-call-parser``) is not a parser
        name: the router must not start then. Without an override, Qwen models from before tool
        calling (no `<tool_call>` token: Qwen1.5, Qwen2) get the plain profile instead. The chat
        template tells DeepSeek V3/R1 calls from V3.1 calls."""
        hint = model_type_hint(model_dir)
        template = tokenizer.chat_templates.get("default")
        try:
            profile = resolve_profile(tokenizer, hint, chat_template=template, override=override)
        except ProfileError as e:
            if override is not None or hint is None or "qwen" not in hint.lower():
                raise
            logger.warning("%s; serving %s without tool calls", e, hint)
            profile = resolve_profile(tokenizer, "plain")
        logger.info("chat output: profile %s (%s, reasoning markers %s)", profile.name, profile.format.value,
                    "yes" if profile.think else "no")
        return cls(profile, tokenizer)

    @property
    def prompt_style(self) -> PromptStyle:
        return PromptStyle.for_profile(self.profile.name)

    @property
    def parsed(self) -> bool:
        """Whether chat output goes through the parser (plain models without think markers don't)."""
        return self.profile.format is not Format.PLAIN or self.profile.think is not None

    def decoder(self, prompt_ids: list[int], stop: list[str], policy: ToolPolicy,
                stop_ids: Iterable[int] = (), include_stop: bool = False,
                skip_special_tokens: bool = True) -> OutputDecoder:
        """A choice's decoder. `skip_special_tokens` applies to plain text only: a parser never
        lets a control token into content (profiles.py)."""
        ends = frozenset(self.tokenizer.stop_token_ids) | frozenset(stop_ids)
        if not self.parsed:
            return TextDecoder(self.tokenizer, stop, include_stop, ends, skip_special_tokens)
        options = policy.parser_options(self.profile, prompt_ids, ends, f"call_{secrets.token_hex(8)}")
        return ParsedDecoder(make_parser(self.profile, options), stop, policy, self.on_diagnostic, include_stop)


def check_output_profile(model_dir: Path, override: str | None = None, tokenizer: Tokenizer | None = None) -> None:
    """For launchers, before any worker starts: ``ProfileError`` when the router would refuse
    (`tokenizer`: the model's, when the caller has loaded it already)."""
    ChatOutput.load(model_dir, tokenizer or Tokenizer(model_dir), override)


def model_type_hint(model_dir: Path) -> str | None:
    """config.json `model_type`, else its first architecture (e.g. DeepseekV32ForCausalLM)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
    hint = cfg.get("model_type") or (archs[0] if archs else None)
    return hint if isinstance(hint, str) else None


def completion_decoder(tokenizer: Tokenizer, stop: list[str], include_stop: bool = False,
                       stop_ids: Iterable[int] = (), skip_special_tokens: bool = True) -> OutputDecoder:
    ends = frozenset(tokenizer.stop_token_ids) | frozenset(stop_ids)
    return TextDecoder(tokenizer, stop, include_stop, ends, skip_special_tokens)
