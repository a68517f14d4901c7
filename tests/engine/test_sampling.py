"""Sampling: seeds repeat, top_k=1 is greedy, penalties and masks do what they say, and a choice
resumed from its tokens so far (``resumed_tokens``) samples on as it would have."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampler import draw_seed, sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence

PROMPTS = [[5, 17, 99, 4], [200, 3, 3, 8, 61, 7, 12], [42] * 9]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=tiny_llama_dir, block_size=4))


def run(engine: LLMEngine, params: list[SamplingParams], prompts=PROMPTS) -> list[list[int]]:
    for i, (p, prm) in enumerate(zip(prompts, params)):
        engine.add_request(f"s{i}", p, prm)
    out: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
    for o in engine.run_until_done():
        if o.token_id is not None:
            out[o.request_id].append(o.token_id)
    return [out[f"s{i}"] for i in range(len(prompts))]


def test_seeded_runs_repeat_exactly(engine):
    params = lambda: [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in (1, 2, 3)]
    first, second = run(engine, params()), run(engine, params())
    assert first == second
    assert len({tuple(x) for x in first}) > 1  # different seeds differ


def test_seeded_run_is_independent_of_batch_neighbours(engine):
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    alone = run(engine, [p], PROMPTS[:1])
    together = run(engine, [p, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
                            SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)])
    assert together[0] == alone[0]


def test_top_k_1_equals_greedy(engine):
    greedy = run(engine, [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 3)
    topk1 = run(engine, [SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True)] * 3)
    assert greedy == topk1


def test_max_tokens_and_min_tokens(engine):
    out = run(engine, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 5, 9)])
    assert [len(x) for x in out] == [1, 5, 9]


def test_stop_token_ids_end_generation(engine):
    free = run(engine, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)], PROMPTS[:1])[0]
    stop = free[3]
    cut = run(engine, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop])],
              PROMPTS[:1])[0]
    assert cut == free[:free.index(stop) + 1]
    held = run(engine, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop],
                                       min_tokens=8)], PROMPTS[:1])[0]
    assert len(held) == 8 and stop not in held  # min_tokens masks the stop token


RESUMABLE = {
    "presence": SamplingParams(temperature=0, presence_penalty=1.5, max_tokens=14, ignore_eos=True),
    "frequency": SamplingParams(temperature=0, frequency_penalty=1.0, max_tokens=14, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=14, ignore_eos=True),
}


@pytest.mark.parametrize("kind", RESUMABLE)
def test_a_choice_resumed_from_its_tokens_goes_on_as_it_would_have(engine, kind):
    """What the router sends when a worker failed a choice after k tokens: the prompt with those
    tokens appended and marked as output. Sent as a plain prompt instead, the same tokens would
    not count as output, and the choice would go on differently."""
    params, k = RESUMABLE[kind], 6
    full = run(engine, [params], PROMPTS[:1])[0]

    def rest(resumed: int) -> list[int]:
        again = dataclasses.replace(params, max_tokens=params.max_tokens - k, resumed_tokens=resumed)
        return run(engine, [again], [PROMPTS[0] + full[:k]])[0]

    assert full[:k] + rest(k) == full
    assert full[:k] + rest(0) != full


SAMPLING = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.3]), top_p=st.sampled_from([1.0, 0.8]),
    top_k=st.sampled_from([0, 20]), min_p=st.sampled_from([0.0, 0.05]),
    presence_penalty=st.sampled_from([0.0, 1.5, -1.0]), frequency_penalty=st.sampled_from([0.0, 0.7]),
    repetition_penalty=st.sampled_from([1.0, 1.3]), seed=st.integers(0, 2**63 - 1),
    min_tokens=st.integers(0, 6), max_tokens=st.just(14), logit_bias=st.sampled_from([{}, {7: 3.0}]))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=SAMPLING, k=st.integers(1, 13), prompt=st.sampled_from(PROMPTS))
def test_any_choice_resumed_after_any_token_goes_on_as_it_would_have(engine, params, k, prompt):
    """The router's continuation (prompt + the first k tokens, max_tokens and min_tokens
    shrunk by k) for any mix of settings, seeded (an unseeded draw is not reproducible)."""
    full = run(engine, [params], [prompt])[0]
    if k >= len(full):  # it ended (EOS) before: nothing to go on from
        return
    again = dataclasses.replace(params, max_tokens=params.max_tokens - k, min_tokens=max(0, params.min_tokens - k),
                                resumed_tokens=k)
    rest = run(engine, [again], [prompt + full[:k]])[0]
    assert full[:k] + rest == full


def test_resumed_tokens_must_leave_a_prompt_token(engine):
    with pytest.raises(ValueError, match="resumed_tokens"):
        engine.add_request("bad", [1, 2], SamplingParams(resumed_tokens=2))
    with pytest.raises(ValueError, match="resumed_tokens"):
        engine.add_request("bad", [1, 2], SamplingParams(resumed_tokens=-1))


def test_a_seeded_draw_depends_on_its_number_not_on_the_draws_before_it():
    """Draw i of a seed is the same whether or not draws 0..i-1 happened here (a PD decode
    worker's first draw is the second of its choice: the prefill worker made the first)."""
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=3)
    alone = sample(logits, [seq_with(params)], outputs=[5])[0][0]
    seq = seq_with(params)
    after = [sample(logits, [seq], outputs=[i])[0][0] for i in range(6)][-1]
    assert alone == after
    assert len({sample(logits, [seq_with(params)], outputs=[i])[0][0] for i in range(20)}) > 10
    assert len({draw_seed(s, i) for s in range(50) for i in range(50)}) == 2500


def seq_with(params: SamplingParams, prompt=(1, 2), output=()) -> Sequence:
    s = Sequence("x", list(prompt), params, frozenset({0}))
    s.output_ids = list(output)
    return s


def test_logit_bias_and_penalties():
    logits = torch.zeros(1, 10)
    logits[0, 3], logits[0, 4] = 1.0, 0.5
    (tok, _), = sample(logits, [seq_with(SamplingParams(temperature=0, logit_bias={7: 5.0}))])
    assert tok == 7
    (tok, _), = sample(logits, [seq_with(SamplingParams(temperature=0, presence_penalty=2.0), output=[3])])
    assert tok != 3
    (tok, _), = sample(logits, [seq_with(SamplingParams(temperature=0, repetition_penalty=10.0), prompt=[3])])
    assert tok == 4  # 1.0 / 10 falls below 0.5
    (tok, _), = sample(logits, [seq_with(SamplingParams(temperature=0, frequency_penalty=0.25), output=[3])])
    assert tok == 3  # 1 - 0.25 still beats 0.5


def test_allowed_token_ids_are_all_that_is_sampled():
    logits = torch.zeros(1, 10)
    logits[0, 3], logits[0, 6] = 5.0, 1.0
    (tok, lp), = sample(logits, [seq_with(SamplingParams(temperature=0, allowed_token_ids=[2, 6], logprobs=1))])
    assert tok == 6 and lp.top == [(6, lp.logprob)]  # the best allowed one; the rest have no mass
    drawn = {sample(logits, [seq_with(SamplingParams(temperature=2.0, seed=s, allowed_token_ids=[2, 6, 8]))])[0][0]
             for s in range(64)}
    assert drawn == {2, 6, 8}
    # min_tokens bans the end, but the end is all that is allowed: it wins, as it does for a grammar
    only_end = SamplingParams(temperature=0, allowed_token_ids=[0], min_tokens=3)
    (tok, _), = sample(logits, [seq_with(only_end)])
    assert tok == 0


def test_a_bad_word_is_never_completed():
    logits = torch.zeros(1, 10)
    logits[0, 3], logits[0, 4], logits[0, 5] = 3.0, 2.0, 1.0
    words = [[3, 4], [9]]  # "3 4" and "9" are bad: 4 is banned only right after a 3

    def pick(output: list[int]) -> int:
        return sample(logits, [seq_with(SamplingParams(temperature=0, bad_words_ids=words), output=output)])[0][0]

    assert (pick([]), pick([3]), pick([4, 3]), pick([3, 1])) == (3, 3, 3, 3)
    logits[0, 3] = -5.0  # now 4 is the favourite, except after a 3
    assert (pick([1]), pick([3])) == (4, 5)
    logits[0, 9] = 10.0  # a one-word ban holds everywhere
    assert pick([1]) == 4
    # what an earlier attempt wrote (resumed_tokens) counts as output
    resumed = Sequence("x", [1, 3], SamplingParams(temperature=0, bad_words_ids=words, resumed_tokens=1),
                       frozenset({0}))
    assert sample(logits, [resumed])[0][0] == 5


def test_logprobs_top_n():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    (tok, lp), = sample(logits, [seq_with(SamplingParams(temperature=0, logprobs=2))])
    assert tok == 1
    assert lp.logprob == pytest.approx(torch.log(torch.tensor(0.6)).item(), abs=1e-6)
    assert [t for t, _ in lp.top] == [1, 2]


def test_min_p_and_top_p_cut_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.45, 0.05]]))
    for params in (SamplingParams(top_p=0.5, seed=0), SamplingParams(min_p=0.2, seed=0)):
        toks = {sample(logits, [seq_with(params)])[0][0] for _ in range(50)}
        assert 2 not in toks


def test_invalid_params_are_refused(engine):
    for bad in (SamplingParams(temperature=-1), SamplingParams(top_p=0), SamplingParams(max_tokens=0),
                SamplingParams(min_tokens=5, max_tokens=2), SamplingParams(top_k=-2)):
        with pytest.raises(ValueError):
            engine.add_request("bad", [1, 2], bad)


def test_a_vanishing_temperature_samples_the_argmax_instead_of_failing():
    # 1e-300 overflows the scaled logits to inf, and softmax(inf - inf) is NaN: the engine
    # must answer with the limit (greedy), never raise inside the loop
    logits = torch.tensor([[0.1, 2.0, 1.5, -3.0]])
    (tok, _), = sample(logits, [seq_with(SamplingParams(temperature=1e-300, seed=0))])
    assert tok == 1
