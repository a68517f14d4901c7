"""Router pieces without processes: request models, errors, SSE, length checks, choices, batching,
output decoding, request ids, worker selection and health bookkeeping, response rendering."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pdserve.frontend import render as sse
from pdserve.frontend.app import RequestIds, client_id
from pdserve.frontend.choices import ChoiceEvent, DeltaBatcher
from pdserve.frontend.errors import APIError, context_too_long, validation_message
from pdserve.frontend.output import OutputDelta, TextDecoder
from pdserve.frontend.protocol import MAX_STOP, ChatCompletionRequest, CompletionRequest
from pdserve.frontend.render import ChatRenderer, CompletionRenderer
from pdserve.frontend.requests import expand_choices, resolve_max_tokens, room_ids, sampling_params
from pdserve.frontend.worker_client import Probe
from pdserve.frontend.workers import WorkerPool
from pdserve.worker_api import GenerateRequest, Info, Load, Role, SamplingParams, TokenLogprob

# ---- request models ----------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_accepts_text_lists_and_token_ids(prompt):
    assert CompletionRequest(prompt=prompt).prompt == prompt


def test_completion_defaults_follow_openai():
    req = CompletionRequest(prompt="x")
    assert (req.max_tokens, req.n, req.stream, req.echo, req.logprobs) == (16, 1, False, False, None)


def test_max_completion_tokens_wins_over_max_tokens():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                max_completion_tokens=7)
    assert req.output_limit == 7


def test_stop_accepts_a_string_or_a_list_up_to_the_limit():
    msgs = [{"role": "user", "content": "x"}]
    assert ChatCompletionRequest(messages=msgs, stop="END").stop_list() == ["END"]
    assert ChatCompletionRequest(messages=msgs, stop=["a"] * MAX_STOP).stop_list() == ["a"] * MAX_STOP
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=msgs, stop=["a"] * (MAX_STOP + 1))


def test_text_content_parts_are_joined():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}])
    assert req.messages[0].text() == "Hello, world"


def test_a_field_foreign_to_the_role_is_an_extra_key_but_the_roles_own_field_is_checked():
    """The OpenAI schema lets a user message carry any extra key, `tool_calls: 5` included (the
    schema test found it): it is dropped when it does not fit, kept when it does. An assistant
    message's own `tool_calls` must still be a list of calls."""
    req = ChatCompletionRequest(messages=[
        {"role": "user", "content": "x", "tool_calls": 5, "tool_call_id": [1], "name": "ann"},
        {"role": "tool", "content": "y", "tool_call_id": "c1", "name": {}},
        {"role": "system", "content": "z", "tool_call_id": "kept"}])
    user, tool, system = req.messages
    assert (user.tool_calls, user.tool_call_id, user.name) == (None, None, "ann")
    assert (tool.tool_call_id, tool.name) == ("c1", None)
    assert system.tool_call_id == "kept"
    for bad in ({"role": "assistant", "content": "x", "tool_calls": 5},
                {"role": "tool", "content": "y", "tool_call_id": 7},
                {"role": "user", "content": "x", "name": 3}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(messages=[bad])


def test_stream_options_need_stream():
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", stream_options={"include_usage": True})
    assert CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True}).include_usage


# ---- errors and SSE ----------------------------------------------------------------------------


def test_error_body_is_an_openai_error_object():
    body = APIError("bad", 400, "invalid_request_error", "n", "x").body()
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": "x"}}


def test_validation_message_names_the_field():
    try:
        ChatCompletionRequest(messages=[{"role": "wizard", "content": "x"}])
    except ValidationError as e:
        message, param = validation_message(e.errors(include_url=False))
    assert param == "messages.0.role"
    assert message.startswith("messages.0.role:")


def test_context_error_carries_the_numbers():
    err = context_too_long(8192, 8000, 500, "messages")
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert all(str(n) in err.message for n in (8192, 8500, 8000, 500))


def test_sse_events_are_data_lines_ending_in_a_blank_line():
    assert sse.event({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert sse.DONE == "data: [DONE]\n\n"
    text = sse.error_event(APIError("boom", 503, "server_error"))
    assert text.startswith("data: ") and text.endswith("\n\n")
    assert json.loads(text[6:])["error"]["message"] == "boom"


# ---- lengths and sampling ----------------------------------------------------------------------


def test_max_tokens_must_fit_the_context_with_the_prompt():
    assert resolve_max_tokens(10, 100, 200, "prompt") == 10
    assert resolve_max_tokens(100, 100, 200, "prompt") == 100  # exactly full is fine
    assert resolve_max_tokens(None, 150, 200, "messages") == 50  # default: what is left
    with pytest.raises(APIError) as e:
        resolve_max_tokens(101, 100, 200, "prompt")
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(APIError):
        resolve_max_tokens(None, 200, 200, "messages")  # no room for even one token


def test_n_choices_get_consecutive_seeds():
    params = SamplingParams(seed=41)
    assert [p.seed for p in expand_choices(params, 3)] == [41, 42, 43]
    copies = expand_choices(SamplingParams(), 2)
    assert [p.seed for p in copies] == [None, None] and copies[0] is not copies[1]


def test_sampling_params_from_request_extras():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_k=-1, min_p=0.1,
                                repetition_penalty=1.2, logit_bias={"5": -100}, seed=-1, stop="z")
    p = sampling_params(req, 8, None, vocab_size=100)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.logit_bias, p.max_tokens) == (0, 0.1, 1.2, {5: -100.0}, 8)
    assert 0 <= p.seed < 2**63 and p.stop == ["z"]
    wire = GenerateRequest(request_id="r", prompt_ids=[1], params=p).wire()["params"]
    assert "stop" not in wire and wire["logit_bias"] == {"5": -100.0}


def test_min_tokens_over_max_tokens_is_a_400_naming_min_tokens():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], min_tokens=9)
    with pytest.raises(APIError) as e:
        sampling_params(req, 4, None, vocab_size=100)
    assert e.value.status == 400 and e.value.param == "min_tokens"


# ---- output decoding and stream batching -------------------------------------------------------


def test_first_token_goes_alone_then_groups_of_n():
    b = DeltaBatcher(3)
    sizes = []
    for t in range(8):
        out = b.add(t, OutputDelta(str(t)))
        if out is not None:
            sizes.append(len(out.token_ids))
    sizes.append(len(b.take().token_ids))
    assert sizes == [1, 3, 3, 1]


def _decode_batched(tokenizer, ids, stop, size):
    dec, b, events = TextDecoder(tokenizer, stop), DeltaBatcher(size), []
    for t in ids:
        out = b.add(t, dec.push(t))
        if out is not None:
            events.append(out)
        if dec.stopped:
            break
    b.add_text(dec.finish())
    events.append(b.take())
    return events, dec.stopped


@pytest.mark.parametrize("stop", [[], ["brown fox"], ["lazy", "quick"], ["\n\n"]])
def test_stream_batching_gives_the_same_text_at_every_n(tokenizer, stop):
    text = "The quick brown fox — naïve café 日本語 — jumps over the lazy dog.\n\nDone. " * 2
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    outputs = set()
    for n in range(1, 9):
        events, _ = _decode_batched(tokenizer, ids, stop, n)
        assert all(len(e.token_ids) <= n for e in events)
        outputs.add("".join(e.delta.content for e in events))
    assert len(outputs) == 1
    (out,) = outputs
    assert out == (text[:min(text.find(s) for s in stop)] if stop else text)


def test_special_tokens_are_not_printed(tokenizer):
    dec = TextDecoder(tokenizer, [])
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    text = "".join(dec.push(t).content for t in ids) + dec.finish().content
    assert text == "assistant\nHi"


def _decoded(dec: TextDecoder, ids: list[int], reason: str) -> str:
    return "".join(dec.push(t).content for t in ids) + dec.finish(reason).content


@pytest.mark.parametrize("include_stop", [False, True])
def test_special_tokens_are_text_when_asked_but_not_the_end_unless_included(tokenizer, include_stop):
    """vLLM's `skip_special_tokens: false`: the markup is text, except the EOS that ended the
    output (`include_stop_str_in_output` keeps it). An EOS the output went past (ignore_eos), or
    the last one of a length-cut output, is text."""
    ends = tokenizer.stop_token_ids
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert ids[-1] in ends and tokenizer.is_special(ids[0])
    shown = TextDecoder(tokenizer, [], include_stop, ends, skip_special_tokens=False)
    assert _decoded(shown, ids, "stop") == "<|im_start|>assistant\nHi" + ("<|im_end|>" if include_stop else "")
    assert _decoded(TextDecoder(tokenizer, [], include_stop, ends, skip_special_tokens=False),
                    ids + ids, "length") == "<|im_start|>assistant\nHi<|im_end|>" * 2
    assert _decoded(TextDecoder(tokenizer, [], include_stop, ends), ids, "stop") == "assistant\nHi"


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_token_that_is_a_word_is_not_text_unless_included(tokenizer, include_stop):
    """vLLM leaves the stop_token_ids entry that ended the output out of its text."""
    ids = tokenizer.encode("The capital of France is Paris")
    paris = ids[-1]
    assert tokenizer.decode([paris]) == " Paris" and not tokenizer.is_special(paris)
    dec = TextDecoder(tokenizer, [], include_stop, tokenizer.stop_token_ids | {paris})
    assert _decoded(dec, ids, "stop") == "The capital of France is" + (" Paris" if include_stop else "")


def test_stop_string_split_across_tokens_is_never_sent(tokenizer):
    dec = TextDecoder(tokenizer, ["STOP HERE"])
    sent = ""
    for t in tokenizer.encode("abc STOP HERE def"):
        sent += dec.push(t).content
        assert "STOP" not in sent
        if dec.stopped:
            break
    assert dec.stopped and sent + dec.finish().content == "abc "


# ---- request ids -------------------------------------------------------------------------------


def test_request_id_is_accepted_or_generated():
    assert client_id("my-id_1.2:3") == "my-id_1.2:3"
    assert len(client_id(None)) == 32
    with pytest.raises(APIError):
        client_id("has space")


def test_a_reused_request_id_gets_a_fresh_room_id():
    ids = RequestIds(remember=2)
    assert [ids.room_base("a"), ids.room_base("a"), ids.room_base("b")] == ["a", "a~1", "b"]
    assert room_ids("r", 1) == ["r"] and room_ids("r", 3) == ["r-0", "r-1", "r-2"]


# ---- worker selection and health ---------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Victim:
    def __init__(self) -> None:
        self.errors: list[APIError] = []

    def fail(self, error: APIError) -> None:
        self.errors.append(error)


def info(worker_id: str, role: Role) -> Info:
    return Info(role=role, worker_id=worker_id, model="m", max_model_len=2048, block_size=16, num_blocks=64,
                tp=1, eos_token_ids=[2])


def _pool(prefill=1, decode=1, both=0, clock=None):
    pool = WorkerPool(None, [f"p{i}:1" for i in range(prefill)], [f"d{i}:1" for i in range(decode)],
                      [f"b{i}:1" for i in range(both)], dead_after_s=1.5, clock=clock or Clock())
    for w in pool.workers:
        w.info = info(w.url, w.role)
        pool.observe(w, Probe(True, "ok"))
    return pool


def test_pick_takes_the_least_loaded_decode_and_prefill():
    pool = _pool(prefill=2, decode=2)
    p0, p1 = pool.of_role(Role.PREFILL)
    d0, d1 = pool.of_role(Role.DECODE)
    d0.load, p1.load = Load(running=3), Load(waiting=2)
    route = pool.pick()
    assert (route.decode, route.prefill) == (d1, p0)


def test_requests_in_flight_count_before_the_next_load_report():
    pool = _pool(decode=2)
    d0, d1 = pool.of_role(Role.DECODE)
    d0.inflight.add(Victim())
    assert pool.pick().decode is d1


def test_colocated_workers_need_no_prefill():
    route = _pool(prefill=0, decode=0, both=1).pick()
    assert route.decode.role is Role.BOTH and route.prefill is None


def test_no_worker_is_a_503():
    pool = _pool()
    for w in pool.workers:
        pool.observe(w, Probe(False, "refused"))
    with pytest.raises(APIError) as e:
        pool.pick()
    assert e.value.status == 503 and not pool.ready


def test_a_refused_port_fails_in_flight_requests_at_once():
    pool = _pool()
    decode = pool.of_role(Role.DECODE)[0]
    victim = Victim()
    decode.inflight.add(victim)
    pool.observe(decode, Probe(False, "refused"))
    assert not decode.healthy and len(victim.errors) == 1 and victim.errors[0].status == 503


def ask(w, at: float) -> None:
    """A probe sent to `w` at `at` and not answered yet (what `WorkerPool.probe` records)."""
    w.asked.append(at)


def answer(pool, w, asked_at: float, probe: Probe, answered_at: float | None = None) -> None:
    """The probe sent at `asked_at` ends: answered (at `answered_at`), or timed out."""
    w.asked.remove(asked_at)
    pool.observe(w, probe, answered_at, asked_at)


def test_a_silent_worker_is_taken_out_after_dead_after_s():
    clock = Clock()
    pool = _pool(clock=clock)
    decode = pool.of_role(Role.DECODE)[0]
    victim = Victim()
    decode.inflight.add(victim)
    ask(decode, clock.t)
    clock.t += 1.0
    answer(pool, decode, clock.t - 1.0, Probe(False, "unreachable"))
    assert decode.healthy and not victim.errors  # one slow probe is not death
    clock.t += 0.5
    pool.observe(decode, Probe(False, "unreachable"))  # the pool's watch: no answer since
    assert not decode.healthy and victim.errors


def test_an_idle_worker_asked_rarely_is_not_slow():
    """Silence is how long a question waits, not how long since the last one: an idle worker
    asked every 2 s with a 1 s bound stays available between its probes."""
    clock = Clock()
    pool = _pool(clock=clock)
    decode = pool.of_role(Role.DECODE)[0]
    for _ in range(3):
        clock.t += 2.0
        pool.observe(decode, Probe(False, "unreachable"))  # the watch, with no question open
        assert decode.available
        ask(decode, clock.t)
        clock.t += 0.02
        answer(pool, decode, clock.t - 0.02, Probe(True, "ok"), clock.t)
        assert decode.available


def test_a_late_answer_from_before_a_pause_does_not_restart_the_silence():
    """A probe's /health answered just before the worker stopped; its /load then waited out its
    timeout. That answer is older than the questions asked after it, which still count from when
    they were asked: the worker is dead `dead_after_s` after its last answer, not a probe
    timeout later."""
    clock = Clock()
    pool = WorkerPool(None, ["p:1"], ["d:1"], [], slow_after_s=1.0, dead_after_s=8.0, clock=clock)
    for w in pool.workers:
        w.info = info(w.url, w.role)
        pool.observe(w, Probe(True, "ok"))
    decode = pool.of_role(Role.DECODE)[0]
    victim = Victim()
    decode.inflight.add(victim)
    t0 = clock.t
    ask(decode, t0)                     # /health answered at t0 + 0.1, then /load hangs
    for k in (1, 2, 3):                 # the worker stopped at t0 + 0.2; the poller asks on
        ask(decode, t0 + 0.5 * k)
    clock.t = t0 + 5.0                  # the first probe's /load times out
    answer(pool, decode, t0, Probe(True, "ok"), answered_at=t0 + 0.1)
    clock.t = t0 + 5.5                  # the second probe times out
    answer(pool, decode, t0 + 0.5, Probe(False, "unreachable"))
    ask(decode, clock.t)
    clock.t = t0 + 8.4
    pool.observe(decode, Probe(False, "unreachable"))
    assert decode.slow and not victim.errors    # silent 7.9 s: slow, not dead yet
    clock.t = t0 + 8.6
    pool.observe(decode, Probe(False, "unreachable"))
    assert not decode.healthy and "did not answer for 8 s" in victim.errors[0].message


def test_a_wedged_worker_gets_no_new_requests_and_fails_its_own_after_the_grace():
    clock = Clock()
    pool = _pool(clock=clock)
    decode = pool.of_role(Role.DECODE)[0]
    victim = Victim()
    decode.inflight.add(victim)
    pool.observe(decode, Probe(True, "wedged"))
    assert not decode.healthy and not pool.ready and not victim.errors
    clock.t += pool.wedged_grace_s
    pool.observe(decode, Probe(True, "wedged"))
    assert victim.errors


def test_a_failed_worker_fails_its_requests_at_once_and_is_back_when_healthy():
    pool = _pool()
    decode = pool.of_role(Role.DECODE)[0]
    victim = Victim()
    decode.inflight.add(victim)
    pool.observe(decode, Probe(True, "failed"))
    assert not decode.healthy and victim.errors
    decode.info = info("d", Role.DECODE)
    pool.observe(decode, Probe(True, "ok"))
    assert decode.healthy and pool.ready


def test_an_answer_to_a_question_asked_before_the_worker_died_does_not_put_it_back():
    """A probe asks /health, then /load; the process may die between the two. Its good answer
    then lands after the refused port was seen (by another probe, the supervisor or a retry)."""
    clock = Clock()
    pool = _pool(clock=clock)
    decode = pool.of_role(Role.DECODE)[0]
    asked = clock.t
    clock.t += 0.1
    pool.observe(decode, Probe(False, "refused"))
    clock.t += 0.1
    pool.observe(decode, Probe(True, "ok"), asked_at=asked)
    assert not decode.healthy and not pool.ready
    pool.observe(decode, Probe(True, "ok"), asked_at=clock.t)  # a new process answers a new question
    assert decode.healthy and pool.ready


def test_a_draining_worker_keeps_its_requests_but_gets_no_new_ones():
    pool = _pool(decode=2)
    d0, d1 = pool.of_role(Role.DECODE)
    victim = Victim()
    d0.inflight.add(victim)
    pool.observe(d0, Probe(True, "draining"))
    assert not victim.errors and {pool.pick().decode for _ in range(3)} == {d1}


def test_a_prefill_worker_without_a_worker_id_is_not_picked():
    pool = _pool()
    pool.of_role(Role.PREFILL)[0].info = None
    assert not pool.ready


# ---- rendering ---------------------------------------------------------------------------------


def _event(index, text, ids, finish=None, logprobs=()):
    from pdserve.frontend.choices import Batch

    return ChoiceEvent(index, Batch(OutputDelta(text), list(ids), list(logprobs)), finish, None, len(ids))


def test_chat_stream_opens_with_the_role_and_ends_with_usage(tokenizer):
    r = ChatRenderer("chatcmpl-x", "m", 2, 10, tokenizer, include_usage=True)
    opening = r.opening()
    assert [c["choices"][0]["delta"] for c in opening] == [{"role": "assistant", "content": ""}] * 2
    [chunk] = r.absorb(_event(1, "Hi", [5], "stop"))
    assert chunk["choices"] == [{"index": 1, "delta": {"content": "Hi"}, "logprobs": None,
                                 "finish_reason": "stop", "stop_reason": None}]
    assert chunk["usage"] is None and chunk["object"] == "chat.completion.chunk"
    assert r.usage_chunk()["choices"] == [] and r.usage_chunk()["usage"]["total_tokens"] == 11
    assert r.absorb(_event(0, "", [])) == []


def test_the_stop_reason_names_the_stop_string_or_the_stop_token_as_vllm_does(tokenizer):
    import dataclasses

    chat = ChatRenderer("chatcmpl-x", "m", 3, 10, tokenizer)
    text = CompletionRenderer("cmpl-x", "m", 3, 10, tokenizer)
    ends = [dataclasses.replace(_event(0, "a", [5], "stop"), stop_sequence="END"),
            dataclasses.replace(_event(1, "b", [7], "stop"), stop_token=7),
            _event(2, "c", [9], "length")]
    streamed = [[r.absorb(ev)[-1]["choices"][0]["stop_reason"] for ev in ends] for r in (chat, text)]
    answered = [[c["stop_reason"] for c in r.response()["choices"]] for r in (chat, text)]
    assert streamed == answered == [["END", 7, None]] * 2


def test_completion_logprobs_have_tokens_and_offsets(tokenizer):
    ids = tokenizer.encode("Hello world")
    lps = [TokenLogprob(token_id=t, logprob=-0.5, top=[(t, -0.5), (0, -3.0)]) for t in ids]
    r = CompletionRenderer("cmpl-x", "m", 1, 3, tokenizer, echo=["Say: "], logprobs=1)
    r.absorb(_event(0, "Hello world", ids, "length", lps))
    choice = r.response()["choices"][0]
    assert choice["text"] == "Say: Hello world"
    assert choice["logprobs"]["tokens"] == ["Hello", " world"]
    assert choice["logprobs"]["text_offset"] == [5, 10]
    assert choice["logprobs"]["top_logprobs"] == [{"Hello": -0.5}, {" world": -0.5}]


def test_completion_top_logprobs_always_hold_the_chosen_token(tokenizer):
    """OpenAI's legacy format: the n most likely tokens, plus the chosen one when it is not
    among them (up to n + 1 entries); logprobs=0 gives the chosen token alone."""
    hello, world = tokenizer.encode("Hello world")
    other = tokenizer.encode(" there")[0]
    lp = TokenLogprob(token_id=world, logprob=-4.0, top=[(other, -0.2), (hello, -1.5)])
    for n, expected in [(0, {" world": -4.0}), (1, {" there": -0.2, " world": -4.0}),
                        (2, {" there": -0.2, "Hello": -1.5, " world": -4.0})]:
        r = CompletionRenderer("cmpl-x", "m", 1, 3, tokenizer, logprobs=n)
        r.absorb(_event(0, " world", [world], "length", [lp]))
        top = r.response()["choices"][0]["logprobs"]["top_logprobs"]
        assert top == [expected] and list(top[0]) == list(expected), n


def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(tokenizer):
    """vLLM's return_tokens_as_token_ids: chat and completion logprobs name the chosen token and
    its alternatives `token_id:<id>` (bytes stay the token's); completion offsets stay in text."""
    hello, world = tokenizer.encode("Hello world")
    lps = [TokenLogprob(token_id=hello, logprob=-1.0, top=[(world, -0.5)]),
           TokenLogprob(token_id=world, logprob=-2.0, top=[(hello, -0.1)])]
    chat = ChatRenderer("chatcmpl-x", "m", 1, 3, tokenizer, top_logprobs=1, tokens_as_ids=True)
    chat.absorb(_event(0, "Hello world", [hello, world], "length", lps))
    content = chat.response()["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["top_logprobs"][0]["token"]) for e in content] == [
        (f"token_id:{hello}", f"token_id:{world}"), (f"token_id:{world}", f"token_id:{hello}")]
    assert content[1]["bytes"] == list(b" world")
    text = CompletionRenderer("cmpl-x", "m", 1, 3, tokenizer, logprobs=1, tokens_as_ids=True)
    text.absorb(_event(0, "Hello world", [hello, world], "length", lps))
    logprobs = text.response()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{hello}", f"token_id:{world}"]
    assert logprobs["top_logprobs"][0] == {f"token_id:{world}": -0.5, f"token_id:{hello}": -1.0}
    assert logprobs["text_offset"] == [0, len("Hello")]


# ---- one choice's life, without workers ----------------------------------------------------------


def test_a_choice_failed_before_its_first_step_still_ends_with_an_error_and_aborts(tokenizer):
    import asyncio

    from pdserve.frontend.choices import ChoiceRun, ChoiceSpec, Services
    from pdserve.frontend.errors import unavailable
    from pdserve.frontend.workers import Route, WorkerEndpoint

    async def scenario():
        events, aborts = [], []

        def spawn(coro):
            aborts.append(coro.cr_frame.f_locals.get("urls") if coro.cr_frame else None)
            coro.close()

        route = Route(WorkerEndpoint("http://d", Role.DECODE), WorkerEndpoint("http://p", Role.PREFILL))
        run = ChoiceRun(ChoiceSpec(0, "r", [1, 2], SamplingParams()), route, TextDecoder(tokenizer, []),
                        events.append, Services(None, spawn))
        assert route.decode.inflight == {run} and route.prefill.inflight == {run}
        run.start()
        run.fail(unavailable("the decode worker died"))
        await asyncio.wait({run._task}, timeout=5)  # the failure ends the choice's task (its callback emits)
        return events, aborts, route

    events, aborts, route = asyncio.run(scenario())
    assert len(events) == 1 and events[0].error.status == 503
    assert aborts == [["http://d", "http://p"]]
    assert not route.decode.inflight and not route.prefill.inflight


def test_a_bug_inside_the_router_ends_the_choice_with_a_500_not_a_stream_that_never_ends(tokenizer):
    """A choice whose run raises something unplanned (here: it has no worker client at all, so
    its /generate call raises AttributeError) ends with an internal error event, is counted out
    of its workers, and its task does not die with the exception unseen."""
    import asyncio

    from pdserve.frontend.choices import ChoiceRun, ChoiceSpec, Services
    from pdserve.frontend.workers import Route, WorkerEndpoint

    async def scenario():
        events = []
        route = Route(WorkerEndpoint("http://d", Role.BOTH), None)
        run = ChoiceRun(ChoiceSpec(0, "r", [1, 2], SamplingParams()), route, TextDecoder(tokenizer, []),
                        events.append, Services(None, lambda coro: coro.close()))
        run.start()
        await asyncio.wait({run._task}, timeout=5)
        return events, route, run._task

    events, route, task = asyncio.run(scenario())
    assert task.done() and task.exception() is None
    assert len(events) == 1 and events[0].error.status == 500
    assert "AttributeError" in events[0].error.message
    assert not route.decode.inflight
