"""The near-tie rule the e2e tests accept a batch's answer by (tests/served_reference.py): it
holds for the two answers "Say hello." really parts between, and not for answers that differ
where the model is sure."""
from __future__ import annotations

from tests.served_reference import chat_near_tie

SAY_HELLO = [{"role": "user", "content": "Say hello."}]


def test_the_near_tie_rule_accepts_a_tie_and_rejects_a_clear_choice(default_model_dir, tokenizer):
    # after "Hello", " there" and "!" are the top two within 3e-4 (fp32 and int16 alike)
    assert chat_near_tie(default_model_dir, tokenizer, SAY_HELLO, "Hello! I'm here to help with",
                         "Hello there, welcome to my world!")
    # the first token: "Hello" leads "I" by 0.4
    assert not chat_near_tie(default_model_dir, tokenizer, SAY_HELLO, "I am here", "Hello there")
    assert not chat_near_tie(default_model_dir, tokenizer, SAY_HELLO, "Hello", "Hello there")
