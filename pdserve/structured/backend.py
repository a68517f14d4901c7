"""The interface a grammar library sits behind: compile a spec once, start matchers from it.

A matcher follows one sequence's output: it fills the packed bitmask of the tokens allowed
next (bit ``t % 32`` of word ``t // 32``, 1 = allowed; EOS only where the grammar accepts)
and consumes each sampled token.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.worker_api import GrammarSpec

if TYPE_CHECKING:  # the router imports this package and never loads torch
    import torch


class GrammarError(ValueError):
    """The spec cannot be used: invalid, or a feature the backend does not implement. The
    message says why, in the backend's words."""


class Matcher(Protocol):
    """One sequence's position in its grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits into ``bitmask[row]`` (int32, CPU, contiguous)."""
        ...

    def consume(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar did not allow it."""
        ...

    @property
    def accepting(self) -> bool:
        """The output so far is a complete document: EOS may come now."""
        ...

    @property
    def error(self) -> str | None:
        ...


class GrammarBackend(ABC):
    """A grammar library bound to one tokenizer."""

    name: str
    vocab_size: int  # the tokenizer's: the width of a bitmask is ceil(vocab_size / 32) words

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar (opaque); raises ``GrammarError``. May take milliseconds: call
        it off the event loop and the scheduler loop (``Grammars`` caches it)."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of the grammar (cheap)."""
