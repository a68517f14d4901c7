"""The parser's view of a vocabulary: token id -> raw bytes, plus marker lookup.

Parsers never look at detokenized text (a ``skip_special_tokens`` decode deletes markers), only
at the exact bytes of each id. Anything with ``token_bytes``, ``token_to_id`` and ``vocab_size``
works (``pdserve.tokenizer.Tokenizer`` does); ``TokenizerVocab`` builds one from a
``tokenizers.Tokenizer`` for tests and tools.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tokenizers import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")
_METASPACE = "\u2581"


@runtime_checkable
class Vocab(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def token_to_id(self, token: str) -> int | None: ...


def gpt2_char_to_byte() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable bytes stand for themselves, the other
    bytes were shifted to U+0100 upwards in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


_CHAR_TO_BYTE = gpt2_char_to_byte()


@dataclass(frozen=True)
class TokenizerVocab:
    """Byte table of every id; built once per tokenizer (~0.2 s for 150k ids)."""

    table: tuple[bytes, ...]
    ids: Mapping[str, int] = field(repr=False)
    special_ids: frozenset[int] = frozenset()
    added_ids: frozenset[int] = frozenset()

    @property
    def vocab_size(self) -> int:
        return len(self.table)

    def token_bytes(self, token_id: int) -> bytes:
        return self.table[token_id] if 0 <= token_id < len(self.table) else b""

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)

    @classmethod
    def from_tokenizer(cls, tok: Tokenizer) -> TokenizerVocab:
        style = _piece_style(json.loads(tok.to_str()).get("decoder"))
        vocab = tok.get_vocab(with_added_tokens=True)
        added = tok.get_added_tokens_decoder()
        size = max([*vocab.values(), *added.keys(), -1]) + 1
        table = [b""] * size
        for piece, i in vocab.items():
            table[i] = piece_bytes(piece, style)
        for i, token in added.items():
            table[i] = token.content.encode("utf-8")
        return cls(tuple(table), dict(vocab),
                   frozenset(i for i, t in added.items() if t.special), frozenset(added))


def piece_bytes(piece: str, style: str) -> bytes:
    """Bytes of one vocabulary piece under the tokenizer's decoding style."""
    if style == "byte_level":
        try:
            return bytes(_CHAR_TO_BYTE[c] for c in piece)
        except KeyError:
            return piece.encode("utf-8")
    if style == "sentencepiece":
        m = _BYTE_PIECE.match(piece)
        return bytes([int(m.group(1), 16)]) if m else piece.replace(_METASPACE, " ").encode("utf-8")
    return piece.encode("utf-8")


def _piece_style(decoder: Mapping[str, Any] | None) -> str:
    kinds = set(_decoder_kinds(decoder))
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"ByteFallback", "Metaspace", "Replace"}:
        return "sentencepiece"
    return "plain"


def _decoder_kinds(decoder: Mapping[str, Any] | None) -> list[str]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [k for child in decoder.get("decoders", []) for k in _decoder_kinds(child)]
    return [str(decoder.get("type"))]
