"""A TP=2 worker (chunked prefill, 8 tokens a step; divergence checked every 4 steps):

* prompt logprobs come with the first token, equal to a log-softmax of transformers' logits,
  and the ranks stay in lockstep;
* its follower rank runs with the gloo idle preload (pdserve/gloo_idle.py, given by rank 0 to the
  ranks it spawns): idle, its gloo loop thread wakes a few times a second instead of 100, and
  the collectives above ran through it."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import transformers

from pdserve import worker_api as api
from pdserve.gloo_idle import library

from .conftest import start_worker

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROMPT = [5, 17, 99, 4, 8, 150, 200, 3, 3, 8, 61, 7, 12, 40, 41, 42, 60, 61, 62, 9]


@pytest.fixture(scope="module")
def worker(tiny_llama4_dir):
    w = start_worker("both", tiny_llama4_dir, "--tp", "2", "--max-num-batched-tokens", "8",
                     "--check-divergence", "4")
    yield w
    w.stop()


def test_tp2_prompt_logprobs_equal_transformers(worker, tiny_llama4_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama4_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    params = api.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    body = api.GenerateRequest(request_id="tp-plp", prompt_ids=PROMPT, params=params)
    with httpx.stream("POST", worker.url + "/generate", json=body.wire(), timeout=120) as r:
        lines = [api.parse_line(text) for text in r.iter_lines() if text]
    assert lines[-1].finish_reason is api.FinishReason.LENGTH
    entries = lines[0].prompt_logprobs
    assert all(line.prompt_logprobs is None for line in lines[1:])
    assert len(entries) == len(PROMPT) and entries[0] is None
    for p, e in enumerate(entries[1:]):
        assert e.token_id == PROMPT[p + 1]
        assert abs(e.logprob - float(ref[p, e.token_id])) < 1e-4, p
        assert [t for t, _ in e.top] == ref[p].topk(2).indices.tolist(), p
    assert lines[0].token_ids == [int(ref[-1].argmax())]
    assert worker.get("/health").status_code == 200  # no divergence was found


def _gloo_loop_wakes(pid: int) -> int:
    for task in Path(f"/proc/{pid}/task").glob("*"):
        if (task / "comm").read_text().strip() == "gloo_tcp_loop":
            return int((task / "status").read_text().split("voluntary_ctxt_switches:")[1].split()[0])
    raise AssertionError(f"process {pid} has no gloo loop thread")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc are Linux's")
def test_an_idle_follower_ranks_gloo_loop_wakes_a_few_times_a_second(worker):
    if library() is None:
        pytest.skip("no C compiler: the preload cannot be built here")
    from tests.frontend.conftest import children_of

    follower = next(pid for pid in children_of(worker.proc.pid) if _has_gloo(pid))  # rank 1
    first, start = _gloo_loop_wakes(follower), time.monotonic()
    time.sleep(1.5)
    per_s = (_gloo_loop_wakes(follower) - first) / (time.monotonic() - start)
    assert per_s < 20, f"the follower's gloo loop thread woke {per_s:.0f} times a second (100 without the preload)"


def _has_gloo(pid: int) -> bool:
    try:
        _gloo_loop_wakes(pid)
        return True
    except (AssertionError, OSError):
        return False
