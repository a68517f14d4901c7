"""`echo` with `logprobs` on /v1/completions, through `pdserve serve`: the prompt's tokens come
first with their logprobs (the first null), equal to a log-softmax of transformers' logits on
the same weights; `max_tokens: 0` scores the prompt alone (lm-eval's loglikelihood call, here
through the official `openai` SDK); streaming sends the echoed prompt with its logprobs before
the first token. PD on the session's server; colocated with chunked prefill (16 tokens a step)
on this module's."""
from __future__ import annotations

import openai
import pytest
import torch
import transformers

from tests.frontend.conftest import start_server, stop_server
from tests.frontend.router_cases import API_KEY
from tests.served_reference import LOGPROB_TOLERANCE, served_reference

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

MODEL = "SmolLM2-135M-Instruct"
TEXT = "The capital of France is Paris, and the capital of Italy is Rome. The capital of Spain is"


@pytest.fixture(scope="module")
def reference(default_model_dir, tokenizer) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and transformers' log-softmax at each position (p predicts p + 1), with
    the served model's activation rounding."""
    ids = tokenizer.encode(TEXT)
    hf = served_reference(transformers.AutoModelForCausalLM.from_pretrained(default_model_dir,
                                                                            dtype=torch.float32).eval())
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return ids, torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module")
def colocated():
    server = start_server("--mode", "colocated", "--api-key", API_KEY, "--max-num-batched-tokens", "16")
    yield openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    stop_server(server.proc)


@pytest.fixture(scope="module")
def pd(pd_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)


def assert_prompt_scored(lp, reference, tokenizer, top: int) -> None:
    ids, ref = reference
    n = len(ids)
    assert lp.tokens[:n] == [tokenizer.token_bytes(t).decode() for t in ids]
    assert "".join(lp.tokens[:n]) == TEXT
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:k])) for k in range(n)]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, n):
        assert abs(lp.token_logprobs[p] - float(ref[p - 1, ids[p]])) < LOGPROB_TOLERANCE, p
        # the `top` most likely, then the prompt's own token when it is not among them
        best = ref[p - 1].topk(top).indices.tolist()
        expected = best + [ids[p]] * (ids[p] not in best)
        assert list(lp.top_logprobs[p]) == [tokenizer.token_bytes(t).decode() for t in expected]
        assert max(abs(a - float(ref[p - 1, t])) for a, t in zip(lp.top_logprobs[p].values(), expected)) \
            < LOGPROB_TOLERANCE


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_score_call_with_the_sdk_equals_transformers(request, mode, reference, tokenizer):
    client = request.getfixturevalue(mode)
    r = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=2, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(reference[0])  # the prompt only
    assert_prompt_scored(choice.logprobs, reference, tokenizer, top=2)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(reference[0])


def test_echo_streams_the_prompt_and_its_logprobs_first(colocated, reference, tokenizer):
    ids, ref = reference
    whole = colocated.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=3,
                                         temperature=0)
    chunks = list(colocated.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=3,
                                               temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == TEXT and first.logprobs.tokens == whole.choices[0].logprobs.tokens[:len(ids)]
    assert_prompt_scored(first.logprobs, reference, tokenizer, top=1)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and text.startswith(TEXT) and len(text) > len(TEXT)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    # the first output token's logprob is the model's at the prompt's last position (greedy: its max)
    assert abs(lp.token_logprobs[len(ids)] - float(ref[-1].max())) < LOGPROB_TOLERANCE
    assert lp.text_offset[len(ids)] == len(TEXT)
