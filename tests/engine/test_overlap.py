"""Overlap scheduling (docs/overlap.md): the engine with `overlap=True` gives exactly the outputs
of the plain loop (greedy, seeded, stop tokens found one step late, max_tokens 1 and 2, n > 1,
preemption, the prefix cache), and an abort that lands during a forward gives the request's
blocks back only after that forward has finished."""
from __future__ import annotations

import threading

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.frontend.requests import expand_choices

PROMPTS = [[5, 17, 99, 4, 8, 150], [200, 3, 3, 8, 61, 7, 12, 40, 41, 42], [42] * 9, [1, 2, 3],
           list(range(10, 60))]


def _engines(model: str, **kw) -> tuple[LLMEngine, LLMEngine]:
    return (LLMEngine(EngineConfig(model=model, block_size=4, **kw)),
            LLMEngine(EngineConfig(model=model, block_size=4, overlap=True, **kw)))


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    plain, over = _engines(tiny_llama_dir)
    yield plain, over
    over.close()


def run(engine: LLMEngine, work: list[tuple[list[int], SamplingParams]], tag: str = "o") -> dict:
    """Every request's tokens, finish reason and logprobs, by request id."""
    for i, (prompt, params) in enumerate(work):
        engine.add_request(f"{tag}{i}", prompt, params)
    out: dict[str, dict] = {f"{tag}{i}": {"tokens": [], "finish": None, "lp": []} for i in range(len(work))}
    for o in engine.run_until_done():
        got = out[o.request_id]
        assert got["finish"] is None, f"{o.request_id}: an output after its finish"
        if o.token_id is not None:
            got["tokens"].append(o.token_id)
            got["lp"].append(None if o.logprobs is None else (round(o.logprobs.logprob, 4), o.logprobs.top))
        got["finish"] = o.finish_reason
        assert o.finish_reason != "error", o.error
    assert engine.allocator.num_free == engine.pool.num_blocks or engine.allocator.caching
    assert not engine.has_work()
    return out


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 10, "ignore_eos": True, **kw})


def test_greedy_seeded_and_max_tokens_equal_the_plain_loop(engines):
    plain, over = engines
    work = [(p, greedy()) for p in PROMPTS]
    work += [(PROMPTS[0], greedy(max_tokens=1)), (PROMPTS[1], greedy(max_tokens=2)),
             (PROMPTS[2], SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True, logprobs=2)),
             (PROMPTS[3], SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=7, ignore_eos=True)),
             (PROMPTS[4], greedy(repetition_penalty=1.3, min_tokens=4))]
    work += [(PROMPTS[1], p) for p in expand_choices(SamplingParams(temperature=1.0, seed=11, max_tokens=6,
                                                                    ignore_eos=True), 3)]  # n = 3
    ref, got = run(plain, work), run(over, work)
    assert got == ref
    assert [len(ref[f"o{i}"]["tokens"]) for i in (5, 6)] == [1, 2]
    assert len({tuple(ref[f"o{i}"]["tokens"]) for i in (10, 11, 12)}) == 3  # the n choices differ


def test_stop_tokens_found_one_step_late_end_where_the_plain_loop_ends(engines):
    plain, over = engines
    full = run(plain, [(p, greedy(max_tokens=12)) for p in PROMPTS], "f")
    # stop on each request's 3rd (or 1st) token: the overlapped loop has computed one token more
    work = [(p, greedy(max_tokens=12, ignore_eos=False, stop_token_ids=[full[f"f{i}"]["tokens"][2 if i % 2 else 0]]))
            for i, p in enumerate(PROMPTS)]
    ref, got = run(plain, work, "s"), run(over, work, "s")
    assert got == ref
    assert all(r["finish"] == "stop" for r in ref.values())
    assert len(ref["s1"]["tokens"]) <= 3 and len(ref["s0"]["tokens"]) == 1


def test_prefix_cache_and_preemption_equal_the_plain_loop(tiny_llama_dir):
    # a pool this small preempts; a second round reuses blocks named while decoding
    plain, over = _engines(tiny_llama_dir, kv_cache_memory=32 * 2048)  # 32 blocks of 2 KiB
    try:
        work = [(p, greedy(max_tokens=14)) for p in PROMPTS]
        ref, got = run(plain, work, "a"), run(over, work, "a")
        assert got == ref
        assert over.scheduler.num_preemptions > 0
        turn2 = [(p + ref[f"a{i}"]["tokens"] + [7], greedy(max_tokens=5)) for i, p in enumerate(PROMPTS)]
        ref2, got2 = run(plain, turn2, "b"), run(over, turn2, "b")
        assert got2 == ref2
        assert over.allocator.num_hits > 0
    finally:
        over.close()


def test_priority_preemption_equals_the_plain_loop(tiny_llama_dir):
    """Two requests of priority -1 arrive while two of priority 5 run with room for two: they
    take the running slots at once (in the overlapped loop, with the victims' tokens in flight),
    and every request's tokens are the plain loop's."""
    plain, over = _engines(tiny_llama_dir, max_num_seqs=2)

    def drive(engine: LLMEngine) -> tuple[dict[str, list[int]], list[str]]:
        for i in range(2):
            engine.add_request(f"low{i}", PROMPTS[i], greedy(max_tokens=12, priority=5))
        outputs, preempted = [], []
        for _ in range(4):
            plan, out = engine.step()
            outputs += out
        for i in range(2):
            engine.add_request(f"high{i}", PROMPTS[2 + i], greedy(max_tokens=6, priority=-1))
        while engine.has_work():
            plan, out = engine.step()
            outputs += out
            preempted += plan.preempted
        tokens: dict[str, list[int]] = {}
        for o in outputs:
            assert o.finish_reason != "error", o.error
            if o.token_id is not None:
                tokens.setdefault(o.request_id, []).append(o.token_id)
        return tokens, preempted

    try:
        (ref, ref_preempted), (got, got_preempted) = drive(plain), drive(over)
        assert got == ref
        assert sorted(ref_preempted) == sorted(got_preempted) == ["low0", "low1"]
        assert [len(ref[r]) for r in ("low0", "low1", "high0", "high1")] == [12, 12, 6, 6]
    finally:
        over.close()


def test_an_abort_during_a_slow_forward_frees_blocks_only_after_it(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, block_size=4, overlap=True, prefix_cache=False))
    gate = threading.Semaphore(0)
    engine.loop.before_forward = gate.acquire  # a forward runs only once the test lets it
    try:
        engine.add_request("slow", PROMPTS[4], greedy(max_tokens=50))
        gate.release(2)
        engine.step()  # forward 0 (the prefill) starts
        engine.step()  # forward 0 ends, forward 1 (a decode on a placeholder) starts
        engine.step()  # forward 1 ends, forward 2 starts and waits at the gate
        held = engine.allocator.num_free
        assert held < engine.pool.num_blocks
        engine.abort("slow")
        outputs: list = []
        stepping = threading.Thread(target=lambda: outputs.extend(engine.step()[1]))
        stepping.start()
        assert engine.loop.waiting_forward.wait(30)  # planned (the abort is in the plan), now waits
        assert engine.allocator.num_free == held    # forward 2 may still write the blocks
        assert not outputs
        gate.release()
        stepping.join(30)
        # the token forward 1 sampled before the abort landed, then the end
        assert [(o.token_id is not None, o.finish_reason) for o in outputs] == [(True, None), (False, "abort")]
        assert engine.allocator.num_free == engine.pool.num_blocks
        engine.loop.before_forward = None
        assert engine.run_until_done() == []  # forward 2's token comes and is dropped
        assert engine.allocator.num_free == engine.pool.num_blocks
    finally:
        gate.release(100)
        engine.close()


def test_stop_strings_on_the_default_model_equal_the_plain_loop(default_model_dir):
    from pdserve.engine.llm import LLM

    plain, over = LLM(EngineConfig(model=default_model_dir)), LLM(EngineConfig(model=default_model_dir, overlap=True))
    try:
        prompt = "What is the capital of France?"
        full, = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=24), chat=True)
        word = full.text.split()[2]
        params = [SamplingParams(temperature=0, max_tokens=24, stop=[word]),
                  SamplingParams(temperature=0, max_tokens=24),  # ends on <|im_end|>, found one step late
                  SamplingParams(temperature=0.7, seed=4, max_tokens=2)]
        ref = plain.generate([prompt] * 3, params, chat=True)
        got = over.generate([prompt] * 3, params, chat=True)
        assert [(c.text, c.token_ids, c.finish_reason) for c in got] == \
            [(c.text, c.token_ids, c.finish_reason) for c in ref]
        assert ref[0].finish_reason == "stop" and word not in ref[0].text
        assert not over.engine.has_work()
    finally:
        over.engine.close()


def test_overlap_flag_reaches_the_workers_engine_config():
    from pdserve.cli import build_parser, engine_config
    from pdserve.launcher import engine_flags

    assert engine_config(build_parser().parse_args(["generate", "hi"])).overlap is False
    assert engine_config(build_parser().parse_args(["generate", "hi", "--overlap"])).overlap is True
    for flag, on in (("--overlap", True), ("--no-overlap", False)):
        flags = engine_flags(build_parser().parse_args(["serve", flag]))
        assert flag in flags
        assert engine_config(build_parser().parse_args(["worker", "--role", "both", *flags])).overlap is on
    assert not [f for f in engine_flags(build_parser().parse_args(["serve"])) if "overlap" in f]


def test_the_plain_loop_hands_a_token_out_before_the_next_forward(engines):
    # the worker's dispatch is the loop's `emit`: a token sampled by forward N reaches its
    # request before forward N+1 runs (with overlap it is out once forward N+1 has ended)
    plain, _ = engines
    events: list[str] = []
    run_batch = plain.loop.run_batch

    def forward(batch, sample):
        if batch:  # a step with nothing to compute still calls it
            events.append("forward")
        return run_batch(batch, sample)

    plain.loop.run_batch = forward
    plain.loop.emit = lambda outs: events.extend(f"token {o.token_id}" for o in outs if o.token_id is not None)
    try:
        plain.add_request("emit0", PROMPTS[0], greedy(max_tokens=3))
        tokens = [f"token {o.token_id}" for o in plain.run_until_done() if o.token_id is not None]
    finally:
        plain.loop.run_batch, plain.loop.emit = run_batch, None
    assert len(tokens) == 3
    assert events == ["forward", tokens[0], "forward", tokens[1], "forward", tokens[2]]
