"""`pdserve generate` prints text, never special tokens (<|im_end|>, <|endoftext|>): its text
stream skips them as the HTTP path does. Read from the CLI's real output, chat and plain."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.textstream import TextStream
from pdserve.tokenizer import Tokenizer


def generate(model_dir: str, prompt: str, *flags: str) -> str:
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "generate", prompt,
                        "--model", model_dir, "--threads", "1", "--max-tokens", "40", *flags],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def specials(tokenizer) -> list[str]:
    names = [tokenizer.decode([i]) for i in sorted(tokenizer.special_ids)]
    assert "<|im_end|>" in names and "<|endoftext|>" in names
    return names


def test_the_text_stream_skips_special_tokens(tokenizer):
    end = tokenizer.token_to_id("<|im_end|>")
    stream = TextStream(tokenizer)
    text = stream.push(tokenizer.encode("Yes.") + [end]) + stream.flush()
    assert text == "Yes."


@pytest.mark.timeout(600)
def test_chat_output_has_no_special_tokens(default_model_dir, specials):
    out = generate(default_model_dir, "Reply with one word: is the sky blue?", "--chat")
    assert out.strip() and not any(s in out for s in specials), out


@pytest.mark.timeout(600)
def test_plain_output_has_no_special_tokens(default_model_dir, specials):
    # the chat markup written by hand: the model ends its turn with <|im_end|> within the budget
    prompt = "<|im_start|>user\nReply with one word: is the sky blue?<|im_end|>\n<|im_start|>assistant\n"
    out = generate(default_model_dir, prompt)
    assert out.strip() and not any(s in out for s in specials), out
