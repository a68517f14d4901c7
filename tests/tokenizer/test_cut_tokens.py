"""`Tokenizer.cut_tokens`: the added tokens after which the rest of a text tokenizes on its own.

Each rule that keeps a token out is pinned by a small tokenizer where splitting after that token
gives other ids than tokenizing the text whole (so the rule is needed), where the token is not a
cut token, and where `PromptPrefixes` still returns the whole text's ids. A plain special token
is one, and there the split gives the same ids."""
from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from pdserve.frontend.prompt_prefixes import PromptPrefixes
from pdserve.tokenizer import Tokenizer

CORPUS = ["hello world, hello there", "a b c d e f g", "the cat sat on the mat", "! ? . , ; :"] * 20


def build(tmp_path: Path, added: list[AddedToken], metaspace_scheme: str | None = None,
          normalizer=None) -> Tokenizer:
    hf = HFTokenizer(models.BPE())
    if metaspace_scheme is None:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=metaspace_scheme)
        hf.decoder = decoders.Metaspace(prepend_scheme=metaspace_scheme)
        alphabet = []
    hf.normalizer = normalizer
    hf.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False))
    hf.add_special_tokens([t for t in added if t.special])
    hf.add_tokens([t for t in added if not t.special])
    out = tmp_path / "tok"
    out.mkdir()
    hf.save(str(out / "tokenizer.json"))
    return Tokenizer(out)


def split_ids(tok: Tokenizer, head: str, tail: str) -> list[int]:
    return tok.encode(head) + tok.encode(tail)


def check_prefixes(tok: Tokenizer, head: str, tail: str) -> None:
    prefixes = PromptPrefixes(tok)
    for text in (head, head + tail):
        assert prefixes.encode(text) == tok.encode(text)


def test_a_plain_special_token_is_a_cut_token(tmp_path):
    tok = build(tmp_path, [AddedToken("<eot>", special=True, normalized=False)])
    eot = tok.token_to_id("<eot>")
    assert tok.cut_tokens[eot] == "<eot>"
    head, tail = "hello<eot>", "  hello world"
    assert split_ids(tok, head, tail) == tok.encode(head + tail)
    prefixes = PromptPrefixes(tok)
    reused: list[int] = []
    prefixes.on_reuse = reused.append
    check_prefixes(tok, head, tail)
    prefixes.encode(head)
    assert prefixes.encode(head + tail) == tok.encode(head + tail)
    assert reused == [len(tok.encode(head))]


EXCLUDED = {
    # rstrip: the token takes the white space after it
    "swallows the space after it": ([AddedToken("<eot>", special=True, normalized=False, rstrip=True)],
                                    None, "hello<eot>", "  world", "<eot>"),
    # leftmost-longest: "<s>!" wins where "!" follows
    "inside a longer one": ([AddedToken("<s>", special=True, normalized=False),
                             AddedToken("<s>!", special=True, normalized=False)], None, "hello<s>", "! world", "<s>"),
    # NFC composes ">" and U+0338 into "≯": the token's last character changes with what follows
    "normalized under a normalizer that composes": ([AddedToken("<n>", special=True, normalized=True)],
                                                    normalizers.NFC(), "hello<n>", "\u0338 world", "<n>"),
    # raw-text tokens are matched first: "b>!" takes the end of "<ab>" when "!" follows
    "normalized, and a raw token can start inside it": ([AddedToken("<ab>", special=True, normalized=True),
                                                         AddedToken("b>!", special=True, normalized=False)],
                                                        None, "hello<ab>", "! world", "<ab>"),
}


@pytest.mark.parametrize("case", list(EXCLUDED))
def test_a_token_after_which_a_split_changes_the_ids_is_not_a_cut_token(tmp_path, case):
    added, normalizer, head, tail, token = EXCLUDED[case]
    tok = build(tmp_path, added, normalizer=normalizer)
    assert split_ids(tok, head, tail) != tok.encode(head + tail)
    check_prefixes(tok, head, tail)  # the ids are right; and for this reason:
    assert tok.token_to_id(token) not in tok.cut_tokens
    assert all(tok.token_to_id(a.content) in tok.cut_tokens for a in added if a.content != token and not a.normalized)


def test_metaspace_marking_only_the_first_piece_turns_caching_off(tmp_path):
    tok = build(tmp_path, [AddedToken("<eot>", special=True, normalized=False)], metaspace_scheme="first")
    head, tail = "hello<eot>", "hello world"
    assert split_ids(tok, head, tail) != tok.encode(head + tail)
    check_prefixes(tok, head, tail)  # the ids are right; and for this reason:
    assert tok.cut_tokens == {}
    assert not PromptPrefixes(tok).enabled


def test_metaspace_marking_every_piece_keeps_it(tmp_path):
    tok = build(tmp_path, [AddedToken("<eot>", special=True, normalized=False)], metaspace_scheme="always")
    head, tail = "hello<eot>", "hello world"
    assert split_ids(tok, head, tail) == tok.encode(head + tail)
    assert tok.token_to_id("<eot>") in tok.cut_tokens


@pytest.mark.parametrize("normalized", [False, True])
def test_without_a_normalizer_a_normalized_token_is_one(tmp_path, normalized):
    tok = build(tmp_path, [AddedToken("<n>", special=True, normalized=normalized)])
    head, tail = "hello<n>", "\u0338 world"
    assert split_ids(tok, head, tail) == tok.encode(head + tail)
    assert tok.token_to_id("<n>") in tok.cut_tokens
