"""Rebuild a Hugging Face ``tokenizer.json`` from the vocabulary stored in a GGUF file.

A GGUF keeps the BPE vocabulary, the merges, a type per token and the *name* of the
pre-tokenizer (``tokenizer.ggml.pre``), not its rules. The rules for each name are the ones
llama.cpp applies; encoding must split text exactly the same way or the model sees token
sequences it was never trained on, so an unknown name is an error, not a guess.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

logger = logging.getLogger(__name__)

# Contractions, letters, digits, other symbols, whitespace: the GPT-2 split shared by most
# byte-level BPE vocabularies; llama3/qwen2 variants differ in digits and line breaks.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp's llama_token_type)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer-related metadata of one GGUF file, as plain Python values."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (sentencepiece)
    pre: str  # tokenizer.ggml.pre
    tokens: Sequence[str]
    token_types: Sequence[int]
    merges: Sequence[str]
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None

    def token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    raw_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact"):
        # Every digit is its own pre-token, then the GPT-2 split.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre in ("llama3", "llama-bpe", "llama-v3", "dbrx", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, raw_bytes])
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, raw_bytes])
    raise ValueError(
        f"unsupported tokenizer.ggml.pre {pre!r}: pdserve knows smollm, starcoder, refact, gpt2, "
        "default, llama-bpe/llama3, dbrx, smaug-bpe and qwen2"
    )


def _split_merge(merge: str, vocab: Mapping[str, int]) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if sep and left in vocab and right in vocab:
        return left, right
    # A token that itself contains a space: try every split point.
    for i, ch in enumerate(merge):
        if ch == " " and merge[:i] in vocab and merge[i + 1 :] in vocab:
            return merge[:i], merge[i + 1 :]
    raise ValueError(f"merge {merge!r} does not split into two vocabulary tokens")


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` that encodes and decodes like llama.cpp does for this vocab."""
    if vocab.model != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model {vocab.model!r} is not supported (only byte-level BPE 'gpt2')"
        )
    token_to_id: dict[str, int] = {}
    for i, tok in enumerate(vocab.tokens):
        token_to_id.setdefault(tok, i)  # first id wins, as in llama.cpp
    merges = [_split_merge(m, token_to_id) for m in vocab.merges]
    ignore_merges = vocab.pre in ("llama3", "llama-bpe", "llama-v3")
    tok = Tokenizer(models.BPE(vocab=token_to_id, merges=merges, ignore_merges=ignore_merges))
    tok.normalizer = None
    tok.pre_tokenizer = _byte_level_pre_tokenizer(vocab.pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(list(_added_tokens(vocab, special=False)))
    tok.add_special_tokens(list(_added_tokens(vocab, special=True)))
    tok.post_processor = _post_processor(vocab)
    return tok


def _added_tokens(vocab: GGUFVocab, special: bool) -> list[AddedToken]:
    """Control tokens become special added tokens; user-defined ones plain added tokens."""
    wanted = TokenType.CONTROL if special else TokenType.USER_DEFINED
    return [
        AddedToken(tok, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
        for tok, ttype in zip(vocab.tokens, vocab.token_types)
        if ttype == wanted
    ]


def _post_processor(vocab: GGUFVocab) -> Any:
    """Add BOS/EOS around each sequence when the GGUF asks for it (add_bos_token etc.)."""
    bos, eos = vocab.token(vocab.bos_token_id), vocab.token(vocab.eos_token_id)
    use_bos = vocab.add_bos_token and bos is not None
    use_eos = vocab.add_eos_token and eos is not None
    if not (use_bos or use_eos):
        return processors.ByteLevel(trim_offsets=False)

    def wrap(seq: str, type_id: int) -> list[str]:
        return [f"{bos}:{type_id}"] * use_bos + [f"{seq}:{type_id}"] + [f"{eos}:{type_id}"] * use_eos

    candidates = ((bos, vocab.bos_token_id, use_bos), (eos, vocab.eos_token_id, use_eos))
    special = [(tok, tok_id) for tok, tok_id, on in candidates if on]
    return processors.TemplateProcessing(
        single=wrap("$A", 0), pair=wrap("$A", 0) + wrap("$B", 1), special_tokens=special
    )


def tokenizer_config(vocab: GGUFVocab, model_max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` that goes with :func:`build_tokenizer`'s output."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": vocab.add_bos_token,
        "add_eos_token": vocab.add_eos_token,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    for key, token_id in (
        ("bos_token", vocab.bos_token_id),
        ("eos_token", vocab.eos_token_id),
        ("unk_token", vocab.unk_token_id),
        ("pad_token", vocab.pad_token_id),
    ):
        if (tok := vocab.token(token_id)) is not None:
            config[key] = tok
    if vocab.chat_template:
        config["chat_template"] = vocab.chat_template
    return config
