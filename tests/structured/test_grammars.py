"""The grammar cache and matchers (llguidance, the default model's tokenizer): compile once,
refuse bad specs with the reason, count live matchers, resume a matcher by replay."""
from __future__ import annotations

import json

import pytest
import torch

from pdserve.structured import GrammarError, GrammarKind, GrammarSpec
from pdserve.structured.bitmask import new_bitmask, unpack

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                     "additionalProperties": False})


def spec(value: str, kind: GrammarKind = GrammarKind.JSON_SCHEMA, strict: bool = True) -> GrammarSpec:
    return GrammarSpec(kind, value, strict)


class Seen:
    def __init__(self) -> None:
        self.compiles: list[bool] = []
        self.live: list[int] = []

    def grammar_compiled(self, seconds: float, cached: bool) -> None:
        self.compiles.append(cached)

    def grammar_masked(self, seconds: float, rows: int) -> None:
        pass

    def grammar_matchers(self, live: int) -> None:
        self.live.append(live)


def test_a_spec_compiles_once_then_comes_from_the_cache(grammars) -> None:
    grammars.observer = seen = Seen()
    first = grammars.compile(spec(SCHEMA))
    assert grammars.compile(spec(SCHEMA)) is first
    assert (grammars.misses, grammars.hits) == (1, 1) and seen.compiles == [False, True]


@pytest.mark.parametrize("value, kind, reason", [
    ('{"type": "foo"}', GrammarKind.JSON_SCHEMA, "Invalid type: foo"),
    ('{"not": {"type": "string"}}', GrammarKind.JSON_SCHEMA, 'Unimplemented keys: ["not"]'),
    ('{"type": "string", "pattern": "(?<=a)b"}', GrammarKind.JSON_SCHEMA, "look-around"),
    ("{not json", GrammarKind.JSON_SCHEMA, "Expecting property name"),
    ("[a-", GrammarKind.REGEX, "unclosed character class"),
    ("[]", GrammarKind.CHOICE, "non-empty list of strings"),
    ("start: foo", GrammarKind.GRAMMAR, "unknown name"),
])
def test_bad_specs_are_refused_with_the_reason_and_the_refusal_is_cached(grammars, value, kind, reason) -> None:
    with pytest.raises(GrammarError, match=None) as e:
        grammars.compile(spec(value, kind))
    assert reason in str(e.value)
    assert grammars.check(spec(value, kind)) == str(e.value) and grammars.misses == 1


def test_non_strict_json_schema_ignores_unimplemented_keywords(grammars) -> None:
    value = '{"type": "object", "not": {"required": ["x"]}}'
    assert grammars.check(spec(value, strict=True)) is not None
    assert grammars.check(spec(value, strict=False)) is None


def test_matchers_are_counted_until_released_once(grammars) -> None:
    grammars.observer = seen = Seen()
    a, b = grammars.start(spec(SCHEMA)), grammars.start(spec(SCHEMA))
    assert grammars.live == 2
    a.release()
    a.release()  # idempotent
    b.release()
    assert grammars.live == 0 and seen.live == [1, 2, 1, 0]


def allowed(state, width: int) -> torch.Tensor:
    mask = new_bitmask(1, width)
    state.matcher.fill_bitmask(mask, 0)
    return unpack(mask, width)[0]


def test_a_replayed_matcher_is_exactly_where_the_incremental_one_is(grammars, tokenizer) -> None:
    """What a decode worker (the prefill's first token) and a preempted recompute rely on."""
    doc = tokenizer.encode('{"n":1234}')
    step = grammars.start(spec(SCHEMA))
    for i in range(len(doc) + 1):
        step.sync(doc[:i])
        replay = grammars.start(spec(SCHEMA))
        replay.sync(doc[:i])
        assert torch.equal(allowed(step, tokenizer.vocab_size), allowed(replay, tokenizer.vocab_size)), i
        replay.release()
    assert step.matcher.accepting and step.matcher.error is None


def test_eos_is_allowed_only_where_the_document_is_complete(grammars, tokenizer) -> None:
    state = grammars.start(spec(SCHEMA))
    eos = tokenizer.eos_token_id
    doc = tokenizer.encode('{"n":7}')
    for i, token in enumerate(doc):
        state.sync(doc[:i])
        assert not allowed(state, tokenizer.vocab_size)[eos], i
    state.sync(doc)
    assert allowed(state, tokenizer.vocab_size)[eos]


def test_a_grammar_with_start_after_constrains_only_after_the_marker(grammars, tokenizer) -> None:
    """Reasoning models: the grammar starts once the reasoning section has ended."""
    from pdserve.engine.sampler import sample
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.sequence import Sequence

    end = tokenizer.encode("</think>")[0]
    marked = GrammarSpec(GrammarKind.CHOICE, '["yes", "no"]', start_after=end)
    seq = Sequence("r", [1, 2], SamplingParams(temperature=0, structured=marked),
                   eos_token_ids=frozenset(tokenizer.stop_token_ids))
    logits = torch.zeros(1, tokenizer.vocab_size)
    chatter = tokenizer.encode(" hmm")[0]
    logits[0, chatter] = 5.0
    seq.output_ids = [chatter]  # still reasoning: nothing is masked
    assert sample(logits, [seq], grammars)[0][0] == chatter and grammars.live == 0
    seq.output_ids = [chatter, end]  # reasoning over: only the choices may start
    token = sample(logits, [seq], grammars)[0][0]
    text = tokenizer.decode([token])
    assert text and any(choice.startswith(text) for choice in ("yes", "no")) and grammars.live == 1
    seq.grammar.release()


def test_boolean_schemas(grammars) -> None:
    assert grammars.check(spec("true")) is None
    assert grammars.check(spec("false")) == "the schema false accepts no document"


def test_a_matcher_in_error_lets_only_eos_through(grammars, tokenizer) -> None:
    from pdserve.engine.sampler import sample
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.sequence import Sequence

    eos = tokenizer.eos_token_id
    seq = Sequence("r", [1], SamplingParams(temperature=1.0, seed=0, structured=spec(SCHEMA)),
                   eos_token_ids=frozenset({eos}))
    seq.output_ids = tokenizer.encode("hello")  # not JSON: the matcher refuses it and stays in error
    assert [sample(torch.zeros(1, tokenizer.vocab_size), [seq], grammars)[0][0] for _ in range(3)] == [eos] * 3
    seq.grammar.release()


def test_a_complete_document_ends_even_under_min_tokens(grammars, tokenizer) -> None:
    """min_tokens bans EOS, but once the grammar allows nothing else the grammar wins."""
    from pdserve.engine.sampler import sample
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.sequence import Sequence

    eos = tokenizer.eos_token_id
    seq = Sequence("r", [1], SamplingParams(temperature=1.0, seed=0, min_tokens=50, max_tokens=60,
                                            structured=spec(SCHEMA)), eos_token_ids=frozenset({eos}))
    seq.output_ids = tokenizer.encode('{"n":5}')
    assert sample(torch.zeros(1, tokenizer.vocab_size), [seq], grammars)[0][0] == eos
    seq.grammar.release()
