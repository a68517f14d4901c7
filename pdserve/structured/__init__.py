"""Structured outputs: grammar-constrained decoding (JSON mode, JSON Schema, regex, choice,
grammars, enforced tool calls). See docs/structured-outputs.md.

* ``spec``: OpenAI request fields → a ``GrammarSpec`` (router side, no backend needed).
* ``backend``: the one small interface a grammar library sits behind; ``llguidance_backend``
  is the one used.
* ``cache``: ``Grammars``, the per-tokenizer compile cache and the matchers' bookkeeping.
* ``bitmask``: applying a packed token bitmask to logits (engine side: imports torch).
* ``factory``: the ``Grammars`` of a tokenizer (router) or of a model directory (worker).
* ``tool_grammars``: Lark grammars of the models' own tool-call syntax (DSML, GLM, Hermes,
  DeepSeek V3/V3.1) for enforced ``tool_choice`` (router side).
"""
from __future__ import annotations

from pdserve.worker_api import GrammarKind, GrammarSpec

from .backend import GrammarBackend, GrammarError, Matcher
from .cache import GrammarObserver, Grammars, GrammarState

__all__ = ["GrammarBackend", "GrammarError", "GrammarKind", "GrammarObserver", "GrammarSpec", "GrammarState",
           "Grammars", "Matcher"]
