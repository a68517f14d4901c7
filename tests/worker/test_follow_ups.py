"""A worker waits for a session's next turn after the step that handed out its answer: the turn
wakes the wait at once; a finish that no turn follows waits the whole window (real worker
process, its internal API on loopback)."""
from __future__ import annotations

import asyncio
import re

import pytest

from .conftest import PDClient, pool_full, start_worker, wait_for

WINDOW_S = 2.0  # long enough that a turn sent the moment its answer is read always comes within it


def greedy(n: int) -> dict:
    return {"temperature": 0, "max_tokens": n, "ignore_eos": True}


def series(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^pdserve:{name}{{[^}}]*{labels}[^}}]*}} (\S+)$", text, re.M)
    assert m, f"no pdserve:{name} {labels} in /metrics"
    return float(m.group(1))


@pytest.mark.e2e
def test_a_turn_sent_after_its_answer_wakes_the_held_step_and_an_unfollowed_finish_waits_out(default_model_dir):
    w = start_worker("both", default_model_dir, "--follow-up-wait-ms", str(WINDOW_S * 1000))
    try:
        asyncio.run(session(w))
        wait_for(lambda: pool_full(w), what="every block back")
        text = w.get("/metrics").text
    finally:
        w.stop()
    # a's answer: its next turn woke the wait; a2's answer: nothing followed, the wait ran out
    assert series(text, "follow_up_waits_total", 'outcome="woken"') == 1
    assert series(text, "follow_up_waits_total", 'outcome="expired"') == 1
    assert WINDOW_S <= series(text, "follow_up_wait_seconds_total") < 2 * WINDOW_S


async def session(w) -> None:
    c = PDClient(None, w)
    prompt = list(range(1000, 1300))
    other = asyncio.create_task(c.generate("b", list(range(2000, 2100)), greedy(64)))  # decodes throughout
    answer, reason, _ = await c.generate("a", prompt, greedy(4))
    assert reason == "length"
    turn, reason, _ = await c.generate("a2", prompt + answer + list(range(3000, 3020)), greedy(4))
    assert reason == "length" and len(turn) == 4
    tokens, reason, _ = await other
    assert reason == "length" and len(tokens) == 64
