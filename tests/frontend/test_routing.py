"""Cache-aware routing (routing.py) without processes: a pool of workers on a fake clock, the
admission that reserves their routes, the policy's index and its bounds."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.frontend.admission import Admission, AdmissionConfig
from pdserve.frontend.errors import APIError
from pdserve.frontend.routing import (CacheAwareRouter, Decision, Policy, PrefixIndex, PromptKey, Reason,
                                      block_hashes)
from pdserve.frontend.worker_client import Probe, WorkerClient
from pdserve.frontend.workers import WorkerPool
from pdserve.metrics import RouterMetrics
from pdserve.worker_api import CachedPrefix, Info, Load, Role

BS = 16


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def pool_of(prefill: int = 0, decode: int = 0, both: int = 0, num_blocks: int = 64) -> WorkerPool:
    pool = WorkerPool(None, [f"p{i}:1" for i in range(prefill)], [f"d{i}:1" for i in range(decode)],
                      [f"b{i}:1" for i in range(both)], clock=Clock())
    for w in pool.workers:
        w.info = Info(role=w.role, worker_id=w.url, model="m", max_model_len=4096, block_size=BS,
                      num_blocks=num_blocks, tp=1, eos_token_ids=[2], max_num_seqs=8)
        pool.observe(w, Probe(True, "ok"))
    return pool


def prompt(session: int, blocks: int = 4, extra: int = 5, shared: bool = True) -> list[int]:
    """A session's prompt: a system prompt of 2 blocks (the same for every session when
    `shared`), then the session's own tokens."""
    system = [3 + i + (0 if shared else 100 * session) for i in range(2 * BS)]
    return system + [1000 * (session + 1) + i for i in range((blocks - 2) * BS + extra)]


async def admit(adm: Admission, ids: list[int], n: int = 1, cache_salt: str | None = None) -> list:
    """Routes of one admitted request; its choices stay on their workers (as registered runs)."""
    async with adm.admit(n, ids, cache_salt) as ticket:
        routes = [ticket.pick() for _ in range(n)]
    for route in routes:
        for w in route:
            if w is not None:
                w.inflight.add(object())
    return routes


def finish(route) -> None:
    for w in route:
        if w is not None:
            w.inflight.pop()


def test_block_hashes_chain_full_blocks_only():
    ids = list(range(40))
    h = block_hashes(ids, BS)
    assert len(h) == 2  # the last 8 tokens are no full block
    assert block_hashes(ids[:32], BS) == h
    other = [7] + ids[1:]
    assert block_hashes(other, BS)[1] != h[1]  # block 1's name stands for its whole prefix


def test_a_conversation_returns_to_the_worker_that_holds_it():
    pool = pool_of(both=2)
    adm = Admission(pool, AdmissionConfig())

    async def go():
        a = (await admit(adm, prompt(0, shared=False)))[0]
        b = (await admit(adm, prompt(1, shared=False)))[0]
        assert a.decode is not b.decode  # nothing cached anywhere: the least loaded
        finish(a)
        finish(b)
        # later turns: the conversation so far plus more; each goes where its first turn went,
        # even when that worker is a little busier
        a.decode.load = Load(running=1)
        for turn in range(1, 4):
            for first, session in ((a, 0), (b, 1)):
                again = (await admit(adm, prompt(session, shared=False) + [9] * 20 * turn))[0]
                assert again.decode is first.decode
                finish(again)
    asyncio.run(go())
    assert adm.routing.decisions == {Reason.PREFIX: 6, Reason.BALANCE: 0, Reason.LOAD: 2}


def test_a_shared_system_prompt_is_a_prefix_too():
    pool = pool_of(both=2)
    adm = Admission(pool, AdmissionConfig())

    async def go():
        a = (await admit(adm, prompt(0)))[0]
        b = (await admit(adm, prompt(1)))[0]  # its first 2 blocks are where a went
        return a, b
    a, b = asyncio.run(go())
    assert a.decode is b.decode
    assert adm.routing.decisions == {Reason.PREFIX: 1, Reason.BALANCE: 0, Reason.LOAD: 1}


def test_a_salted_prompt_matches_only_what_was_sent_with_its_salt():
    """The workers name a salted request's blocks under its salt, so the index does too: the
    same prompt with another salt, or none, holds nothing where the first one went."""
    ids = list(range(40))
    assert block_hashes(ids, BS, "a") == block_hashes(ids, BS, "a") != block_hashes(ids, BS)
    assert not set(block_hashes(ids, BS, "a")) & set(block_hashes(ids, BS, "b"))
    pool = pool_of(both=2)
    adm = Admission(pool, AdmissionConfig())

    async def go():
        a = (await admit(adm, prompt(0), cache_salt="tenant-a"))[0]
        b = (await admit(adm, prompt(0), cache_salt="tenant-b"))[0]
        assert b.decode is not a.decode  # nothing of b's is cached anywhere: the least loaded
        finish(a)
        finish(b)
        a.decode.load = Load(running=1)
        again = (await admit(adm, prompt(0) + [5] * 20, cache_salt="tenant-a"))[0]
        assert again.decode is a.decode
    asyncio.run(go())
    assert adm.routing.decisions == {Reason.PREFIX: 1, Reason.BALANCE: 0, Reason.LOAD: 2}


def test_pd_chooses_both_workers_by_prefix():
    pool = pool_of(prefill=2, decode=2)
    adm = Admission(pool, AdmissionConfig())

    async def go():
        first = (await admit(adm, prompt(0)))[0]
        finish(first)
        first.prefill.load = first.decode.load = Load(running=1)
        second = (await admit(adm, prompt(0) + [5] * 20))[0]
        assert second.prefill is first.prefill  # it computes only what it lacks
        assert second.decode is first.decode    # it keeps the KV it received: fewer blocks travel
        third = (await admit(adm, prompt(1, shared=False)))[0]
        assert third.prefill is not first.prefill and third.decode is not first.decode  # the least loaded
    asyncio.run(go())
    assert adm.routing.decisions == {Reason.PREFIX: 2, Reason.BALANCE: 0, Reason.LOAD: 4}


class Holding:
    """The /cached_prefix answers of a `WorkerClient`: `blocks[url]` leading blocks held (None: no
    answer in time)."""

    def __init__(self) -> None:
        self.blocks: dict[str, int | None] = {}

    async def cached_prefix(self, url: str, names: str, timeout_s: float) -> CachedPrefix | None:
        n = self.blocks.get(url)
        return None if n is None else CachedPrefix(device_blocks=n, host_blocks=0, load=Load())


def test_pd_sends_a_prompt_its_decode_worker_holds_but_for_a_few_tokens_to_that_worker_alone():
    """--local-prefill-tokens: a prompt the decode worker says it holds all but N tokens of goes
    to it alone. The router's record is not enough: it counts a prompt as held once sent, before
    its KV landed. A prompt with more uncached tokens, a worker that does not answer, the flag at
    0, or a decode worker without a prefix cache: through a prefill worker."""
    def pd(flag: int, caches: bool = True, ask: bool = True) -> tuple[Admission, Holding]:
        pool = pool_of(prefill=1, decode=1)
        for w in pool.workers:
            if caches:
                w.info = w.info.model_copy(update={"prefix_salt": "ab" * 16})
        pool.client = Holding()
        return Admission(pool, AdmissionConfig(local_prefill_tokens=flag, ask_caches=ask)), pool.client

    adm, holding = pd(24)
    metrics = RouterMetrics("m")
    metrics.watch_admission(adm)
    decode = adm.pool.of_role(Role.DECODE)[0].url
    later = prompt(0) + [7] * 19  # 5 + 19 = 24 tokens past 4 blocks

    async def route(admission: Admission, ids: list[int]):
        r = (await admit(admission, ids))[0]
        finish(r)
        return r

    async def go():
        holding.blocks[decode] = 0
        assert (await route(adm, prompt(0))).prefill is not None  # 69 tokens, nothing held
        assert (await route(adm, later)).prefill is not None      # sent there, but not landed yet
        holding.blocks[decode] = 4
        assert (await route(adm, later)).prefill is None          # the 24 past what it holds
        assert (await route(adm, prompt(0) + [8] * 20)).prefill is not None  # 25: one too many
        holding.blocks[decode] = None
        assert (await route(adm, later)).prefill is not None      # no answer in time
        assert (await route(adm, [9] * 24)).prefill is None       # 24 tokens in all
        no_ask, _ = pd(24, ask=False)  # --no-ask-caches: the record decides
        assert (await route(no_ask, prompt(0))).prefill is not None
        assert (await route(no_ask, later)).prefill is None
        for admission, held in (pd(0), pd(24, caches=False)):
            held.blocks[decode] = 5
            assert (await route(admission, later)).prefill is not None
    asyncio.run(go())
    assert 'pdserve:local_prefills_total{model_name="m",role="router"} 2.0' in metrics.render().decode()


def test_an_overloaded_holder_is_passed_over_for_the_least_loaded():
    pool = pool_of(both=2)
    adm = Admission(pool, AdmissionConfig())
    hot = prompt(0)

    async def go():
        holder = (await admit(adm, hot))[0].decode
        other = next(w for w in pool.workers if w is not holder)
        # the holder fills up with requests of the hot prefix while the other stays idle
        picked = [(await admit(adm, hot))[0].decode for _ in range(4)]
        return holder, other, picked
    holder, other, picked = asyncio.run(go())
    # holder's load 1, 2, 3 against 0: within the bound (2 more, 1.5×); at 3 more it is passed over
    assert picked[:2] == [holder, holder] and picked[2] is other
    assert adm.routing.decisions[Reason.BALANCE] == 1
    # the other worker now holds the hot prefix too: the next one goes to the less loaded holder
    assert picked[3] is other and adm.routing.decisions[Reason.PREFIX] == 3


def test_what_a_worker_reports_holding_counts_as_the_index_does():
    """`ask` fills `PromptKey.reported` with the workers' answers to /cached_prefix (end to end in
    test_routing_e2e.py): a worker that reports more leading blocks than the index credits
    another with gets the request, and an overloaded one is passed over as a holder would be."""
    pool = pool_of(both=2)
    router = CacheAwareRouter()
    a, b = pool.workers
    ids = prompt(0)
    router.record(Decision(a, Reason.PREFIX, 0), PromptKey(ids[:2 * BS]))  # the index: a has the system prompt
    key = PromptKey(ids)
    key.reported[b] = 3  # b says it holds three blocks: another router sent it this conversation
    assert router.decide(pool.workers, key) == Decision(b, Reason.PREFIX, 3)
    key.reported[b] = 1  # fewer than the index credits a with
    assert router.decide(pool.workers, key) == Decision(a, Reason.PREFIX, 2)
    key.reported[b] = 3
    b.load = Load(running=6)
    assert router.decide(pool.workers, key) == Decision(a, Reason.BALANCE, 0)


def test_a_worker_that_leaves_the_rotation_while_it_is_asked_counts_as_unanswered():
    """The pool drops a worker's /info when it leaves the rotation, which may happen while `ask`
    names the prompt's blocks in a thread (a chaos run found a choice dying of it). Here the
    first worker leaves at that moment; nobody listens at either URL, so neither answers."""
    pool = pool_of(both=2)
    for w in pool.workers:
        w.info = w.info.model_copy(update={"prefix_salt": "ab" * 16})
    router = CacheAwareRouter()
    outcomes: list[bool] = []
    router.on_ask = outcomes.append
    key = PromptKey(prompt(0))

    async def go():
        client = WorkerClient()
        asyncio.get_running_loop().call_soon(setattr, pool.workers[0], "info", None)
        try:
            await router.ask(client, pool.workers, key)
        finally:
            await client.aclose()
    asyncio.run(go())
    assert pool.workers[0].info is None  # it left while the names were computed
    assert outcomes == [False, False] and key.reported == {}


def test_least_loaded_routing_ignores_prefixes():
    pool = pool_of(both=2)
    adm = Admission(pool, AdmissionConfig(routing="least-loaded"))

    async def go():
        a = (await admit(adm, prompt(0)))[0]
        b = (await admit(adm, prompt(0)))[0]
        return a, b
    a, b = asyncio.run(go())
    assert a.decode is not b.decode
    assert adm.routing.decisions == {Reason.PREFIX: 0, Reason.BALANCE: 0, Reason.LOAD: 2}
    with pytest.raises(ValueError):
        AdmissionConfig(routing="random")


def test_the_index_is_an_lru_bounded_by_the_workers_pool():
    idx = PrefixIndex(capacity=8)
    first, second = PromptKey(prompt(0, blocks=6)), PromptKey(prompt(1, blocks=6))
    idx.insert(first.hashes(BS))
    assert idx.match(first.hashes(BS)) == 6
    idx.insert(second.hashes(BS))  # 4 new blocks (the system prompt's 2 are shared): 10 > 8
    assert len(idx) == 8
    assert idx.match(second.hashes(BS)) == 6
    assert idx.match(first.hashes(BS)) == 2  # its own blocks were least recently sent: evicted first

    pool = pool_of(both=1, num_blocks=5)
    router = CacheAwareRouter()
    w = pool.workers[0]
    for s in range(10):
        router.record(router.decide(pool.workers, PromptKey(prompt(s))), PromptKey(prompt(s)))
    assert len(router.index(w)) == 5  # bounded by the worker's pool however much is sent


def test_a_worker_that_leaves_or_restarts_is_forgotten():
    pool = pool_of(both=2)
    router = CacheAwareRouter()
    key = PromptKey(prompt(0))
    w0, w1 = pool.workers
    w0.last_pick = 1.0  # w1 wins ties
    router.record(router.decide([w0], key), key)
    assert router.decide(pool.workers, key) == (w0, Reason.PREFIX, 4)
    pool.observe(w0, Probe(False, "refused"))  # died: out of rotation, its cache is gone
    router.retain(pool.workers)
    pool.observe(w0, Probe(True, "ok"))
    w0.info = w1.info
    assert router.decide(pool.workers, key) == (w1, Reason.LOAD, 0)
    # back with a new /info without a probe seeing it down (a quick restart): forgotten too
    router.record(router.decide([w0], key), key)
    assert router.decide(pool.workers, key).worker is w0
    w0.info = w0.info.model_copy(update={"worker_id": "new"})
    assert router.decide(pool.workers, key) == (w1, Reason.LOAD, 0)
    # a worker removed from the pool: its index goes
    router.record(router.decide([w1], key), key)
    pool.workers.remove(w1)
    router.retain(pool.workers)
    assert w1 not in router._index


def test_a_request_refused_for_room_records_nothing():
    pool = pool_of(both=1)
    adm = Admission(pool, AdmissionConfig(worker_capacity=1, queue_timeout_s=0.05))

    async def go():
        await admit(adm, prompt(0))
        with pytest.raises(APIError):
            await admit(adm, prompt(1))  # no room: 429 after waiting
    asyncio.run(go())
    assert sum(adm.routing.decisions.values()) == 1


def test_routing_decisions_are_on_the_routers_metrics():
    pool = pool_of(both=2)
    adm = Admission(pool, AdmissionConfig())
    metrics = RouterMetrics("m")
    metrics.watch_admission(adm)

    async def go():
        await admit(adm, prompt(0))
        await admit(adm, prompt(0))
    asyncio.run(go())
    text = metrics.render().decode()
    assert 'pdserve:routing_decisions_total{model_name="m",reason="prefix",role="router"} 1.0' in text
    assert 'pdserve:routing_decisions_total{model_name="m",reason="load",role="router"} 1.0' in text
    assert Policy("cache-aware") is Policy.CACHE_AWARE


def test_serve_starts_the_workers_it_is_told_and_hands_their_urls_to_the_router(tmp_path):
    from pdserve.cli import build_parser
    from pdserve.launcher import role_urls, worker_commands

    args = build_parser().parse_args(["serve", "--mode", "pd", "--prefill-workers", "2", "--decode-workers", "3"])
    workers = worker_commands(args, tmp_path)
    assert [name for name, _, _ in workers] == ["prefill-1", "prefill-2", "decode-1", "decode-2", "decode-3"]
    assert len({url for _, _, url in workers}) == 5
    urls = role_urls((name, url) for name, _, url in workers)
    assert {role: len(u) for role, u in urls.items()} == {"prefill": 2, "decode": 3}
    one = build_parser().parse_args(["serve", "--mode", "colocated"])
    assert [name for name, _, _ in worker_commands(one, tmp_path)] == ["worker"]
    two = build_parser().parse_args(["serve", "--mode", "colocated", "--workers", "2", "--routing", "least-loaded"])
    assert [name for name, _, _ in worker_commands(two, tmp_path)] == ["worker-1", "worker-2"]
    assert two.routing == "least-loaded"
