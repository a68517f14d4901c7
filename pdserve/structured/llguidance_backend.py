"""The llguidance backend (why llguidance: docs/structured-outputs.md).

The tokenizer is given to llguidance as the byte string of every token id, read from
pdserve's own ``Tokenizer`` (the same table the output parsers use), so any tokenizer the
router serves works, Hugging Face or converted GGUF alike.
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import llguidance

from pdserve.tokenizer import Tokenizer
from pdserve.worker_api import GrammarKind, GrammarSpec

from .backend import GrammarBackend, GrammarError

if TYPE_CHECKING:  # the router compiles grammars and never loads torch
    import torch

logger = logging.getLogger(__name__)

# Compact JSON (no free white space): a small model cannot wander off into endless blanks, and
# a document is only as long as its content.
_JSON_OPTIONS = {"whitespace_flexible": False}


class _Vocab:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        # Every added token is special to llguidance, marked or not (V4's DSML, GLM's and Qwen's
        # <tool_call>, <think>): the parsers read them by id as markup, so no text lexeme (a JSON
        # string, a free value) may contain one; a grammar names them by id (`<[id]>`).
        self.special_token_ids = sorted(tokenizer.special_ids | tokenizer.added_token_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


class LLGuidanceMatcher:
    __slots__ = ("_m",)

    def __init__(self, m: llguidance.LLMatcher) -> None:
        self._m = m

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def consume(self, token_id: int) -> bool:
        return self._m.consume_token(token_id)

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer) -> None:
        eos = sorted(tokenizer.stop_token_ids) or None
        self._tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(tokenizer)),
                                           n_vocab=tokenizer.vocab_size, eos_token=eos)
        self.vocab_size = tokenizer.vocab_size

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        grammar = _grammar(spec)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tok)
        if failed:
            raise GrammarError(messages[0].strip())
        for warning in messages:
            logger.info("grammar warning: %s", warning)
        template = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        return template

    def matcher(self, compiled: llguidance.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy())


def _grammar(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar; GrammarError when it is not even well-formed."""
    try:
        if spec.kind is GrammarKind.JSON_SCHEMA:
            schema = json.loads(spec.value)
            if schema is False:
                raise GrammarError("the schema false accepts no document")
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise GrammarError("a JSON Schema must be an object or a boolean")
            options = dict(_JSON_OPTIONS, lenient=not spec.strict)
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        if spec.kind is GrammarKind.CHOICE:
            choices = json.loads(spec.value)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choice must be a non-empty list of strings")
            return llguidance.grammar_from("choice", spec.value)
        if spec.kind is GrammarKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(spec.value)
        return llguidance.grammar_from("grammar", spec.value)
    except GrammarError:
        raise
    except ValueError as e:  # json's JSONDecodeError is one; so is a GBNF conversion failure
        raise GrammarError(str(e)) from None
