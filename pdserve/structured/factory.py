"""The ``Grammars`` of a tokenizer (the router) or of a model directory (a worker)."""
from __future__ import annotations

from pathlib import Path

from pdserve.tokenizer import Tokenizer

from .cache import Grammars
from .llguidance_backend import LLGuidanceBackend


def grammars_for_tokenizer(tokenizer: Tokenizer) -> Grammars:
    return Grammars(lambda: LLGuidanceBackend(tokenizer))


def grammars_for_model(model_dir: str | Path) -> Grammars:
    """The tokenizer is read on first use: workers that never see a grammar never load it."""
    return Grammars(lambda: LLGuidanceBackend(Tokenizer(model_dir)))
