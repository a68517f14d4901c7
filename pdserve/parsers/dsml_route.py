"""The DSML tag transition table (spec §2.5) as one pure function.

`route(state, tag, ...)` says what a complete tag does in a state. Actions marked "then
re-route" leave the tag pending: the parser applies them and routes the same tag again in
the new state (e.g. a missing `</invoke>` before `</function_calls>`).
"""
from __future__ import annotations

from enum import Enum

from pdserve.parsers.dsml_header import Tag, TagKind


class State(Enum):
    TEXT = "text"          # reasoning or content (which one: TextChannels.reasoning)
    BLOCK = "block"        # inside <BLOCK>, between invokes
    INVOKE = "invoke"      # inside <invoke>, between parameters
    PARAM = "param"        # inside a parameter value
    JSONBODY = "jsonbody"  # lenient: a raw JSON object as the invoke body
    TAG = "tag"            # collecting a tag header up to `>`


class Action(Enum):
    OPEN_BLOCK = "open_block"              # TEXT -> BLOCK
    IMPLICIT_BLOCK = "implicit_block"      # TEXT -> BLOCK, then re-route (bare <invoke>)
    START_CALL = "start_call"              # BLOCK -> INVOKE
    END_BLOCK = "end_block"                # BLOCK -> TEXT (content, after-block)
    START_PARAM = "start_param"            # INVOKE -> PARAM
    END_CALL = "end_call"                  # INVOKE -> BLOCK
    IMPLICIT_END_CALL = "implicit_end_call"    # INVOKE -> BLOCK, then re-route
    END_PARAM = "end_param"                # PARAM -> INVOKE
    IMPLICIT_END_PARAM = "implicit_end_param"  # PARAM -> INVOKE, then re-route
    END_BODY = "end_body"                  # JSONBODY -> INVOKE, then re-route
    DROP = "drop"                          # stray tag: dropped whole, with a diagnostic
    FAIL = "fail"                          # strict: any deviation from the reference grammar

    @property
    def reroutes(self) -> bool:
        return self in (Action.IMPLICIT_BLOCK, Action.IMPLICIT_END_CALL, Action.IMPLICIT_END_PARAM,
                        Action.END_BODY)


def route(state: State, tag: Tag, strict: bool, in_reasoning: bool = False) -> Action:
    kind, closing = tag.kind, tag.closing
    if state is State.TEXT:
        if kind is TagKind.BLOCK and not closing:
            return Action.FAIL if strict and in_reasoning else Action.OPEN_BLOCK
        if kind is TagKind.INVOKE and not closing:
            return Action.FAIL if strict else Action.IMPLICIT_BLOCK
        return _stray(strict)
    if state is State.BLOCK:
        if kind is TagKind.INVOKE and not closing:
            return Action.START_CALL
        if kind is TagKind.BLOCK and closing:
            return Action.END_BLOCK
        return _stray(strict)
    if state is State.INVOKE:
        if kind is TagKind.PARAM and not closing:
            return Action.START_PARAM
        if kind is TagKind.INVOKE and closing:
            return Action.END_CALL
        if (kind is TagKind.BLOCK and closing) or (kind is TagKind.INVOKE and not closing):
            return Action.FAIL if strict else Action.IMPLICIT_END_CALL
        return _stray(strict)
    if state is State.PARAM:
        if kind is TagKind.PARAM and closing:
            return Action.END_PARAM
        return Action.FAIL if strict else Action.IMPLICIT_END_PARAM
    if state is State.JSONBODY:
        return Action.FAIL if strict else Action.END_BODY
    raise ValueError(f"no tag routing in state {state}")


def _stray(strict: bool) -> Action:
    return Action.FAIL if strict else Action.DROP
