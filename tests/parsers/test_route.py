"""The DSML and GLM transition tables are pure functions: strict mode never repairs, lenient
mode never fails, and the normal path of the reference grammar needs no repair."""
from __future__ import annotations

import itertools

from pdserve.parsers import glm
from pdserve.parsers.dsml_header import Tag, TagKind, ValueKind, lex_header
from pdserve.parsers.dsml_route import Action, State, route

REPAIRS = {Action.IMPLICIT_BLOCK, Action.IMPLICIT_END_CALL, Action.IMPLICIT_END_PARAM, Action.END_BODY, Action.DROP}
TAGS = [Tag(kind, closing) for kind, closing in itertools.product(TagKind, (False, True))]
STATES = [State.TEXT, State.BLOCK, State.INVOKE, State.PARAM, State.JSONBODY]


def test_strict_never_repairs_and_lenient_never_fails() -> None:
    for state, tag, reasoning in itertools.product(STATES, TAGS, (False, True)):
        assert route(state, tag, strict=True, in_reasoning=reasoning) not in REPAIRS
        assert route(state, tag, strict=False, in_reasoning=reasoning) is not Action.FAIL


def test_reference_grammar_path() -> None:
    path = [(State.TEXT, TagKind.BLOCK, False, Action.OPEN_BLOCK),
            (State.BLOCK, TagKind.INVOKE, False, Action.START_CALL),
            (State.INVOKE, TagKind.PARAM, False, Action.START_PARAM),
            (State.PARAM, TagKind.PARAM, True, Action.END_PARAM),
            (State.INVOKE, TagKind.INVOKE, True, Action.END_CALL), (State.BLOCK, TagKind.BLOCK, True, Action.END_BLOCK)]
    for state, kind, closing, action in path:
        assert route(state, Tag(kind, closing), strict=True) is action


def test_header_lexing_strict_and_lenient() -> None:
    strict = lex_header(b'parameter name="city" string="true"', False, "function_calls", strict=True)
    assert (strict.kind, strict.name, strict.value) == (TagKind.PARAM, "city", ValueKind.STRING)
    assert lex_header(b'parameter  name="c"', False, "function_calls", strict=True).kind is TagKind.UNKNOWN
    lenient = lex_header(b' parameter\tname="c" ', False, "function_calls", strict=False)
    assert (lenient.kind, lenient.name, lenient.value) == (TagKind.PARAM, "c", ValueKind.AUTO)
    assert lex_header(b"tool_calls", True, "function_calls", strict=True).kind is TagKind.UNKNOWN
    assert lex_header(b" calls", False, "tool_calls", strict=False).kind is TagKind.BLOCK  # V4.1 spacing


def test_glm_table_strict_never_repairs() -> None:
    for state, mark in itertools.product(glm.State, glm.Mark):
        assert glm.route(state, mark, True) not in (glm.Action.IMPLICIT_CLOSE, glm.Action.DROP)
        assert glm.route(state, mark, False) is not glm.Action.FAIL
