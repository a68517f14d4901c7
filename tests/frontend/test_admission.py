"""Liveness (busy is not dead) and admission control, without processes: the pool's state
machine on a fake clock, the admission queue on real asyncio."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.frontend.admission import Admission, AdmissionConfig, Rejection
from pdserve.frontend.errors import APIError
from pdserve.frontend.worker_client import Probe
from pdserve.frontend.workers import WorkerPool
from pdserve.worker_api import Info, Load, Role


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Victim:
    def __init__(self, priority: int = 0) -> None:
        self.errors: list[APIError] = []
        self.priority = priority

    def fail(self, error: APIError) -> None:
        self.errors.append(error)


def pool_of(prefill: int = 1, decode: int = 1, clock: Clock | None = None, max_num_seqs: int = 2,
            both: int = 0) -> WorkerPool:
    pool = WorkerPool(None, [f"p{i}:1" for i in range(prefill)], [f"d{i}:1" for i in range(decode)],
                      [f"b{i}:1" for i in range(both)], slow_after_s=3.0, dead_after_s=30.0, clock=clock or Clock())
    for w in pool.workers:
        w.info = Info(role=w.role, worker_id=w.url, model="m", max_model_len=2048, block_size=16,
                      num_blocks=64, tp=1, eos_token_ids=[2], max_num_seqs=max_num_seqs)
        pool.observe(w, Probe(True, "ok"))
    return pool


# ---- liveness ------------------------------------------------------------------------------------


def test_a_silent_worker_is_slow_first_keeps_its_requests_then_is_dead_past_the_bound():
    clock = Clock()
    pool = pool_of(clock=clock)
    decode = pool.of_role(Role.DECODE)[0]
    victim = Victim()
    decode.inflight.add(victim)
    clock.t += 3.0
    pool.observe(decode, Probe(False, "unreachable"), asked_at=clock.t - 3.0)  # a question 3 s unanswered
    assert decode.slow and not decode.available and decode.in_rotation and pool.ready
    assert not victim.errors  # busy is not dead: what runs there goes on
    clock.t += 20.0
    pool.observe(decode, Probe(True, "ok"))
    assert decode.available and not decode.slow and not victim.errors
    clock.t += 30.0
    pool.observe(decode, Probe(False, "unreachable"), asked_at=clock.t - 30.0)
    assert not decode.healthy and len(victim.errors) == 1
    assert victim.errors[0].status == 503 and "did not answer for 30 s" in victim.errors[0].message


def test_a_refused_port_is_dead_at_once():
    pool = pool_of()
    decode = pool.of_role(Role.DECODE)[0]
    victim = Victim()
    decode.inflight.add(victim)
    pool.observe(decode, Probe(False, "refused"))
    assert not decode.healthy and len(victim.errors) == 1 and not pool.ready


# ---- admission -----------------------------------------------------------------------------------


def admission(pool: WorkerPool, **kw) -> Admission:
    return Admission(pool, AdmissionConfig(**{"max_queue": 4, "queue_timeout_s": 5.0, **kw}))


async def hold(adm: Admission, n: int = 1, priority: int = 0) -> list[Victim]:
    """Admit `n` choices and register them on their workers, as a Generation does."""
    async with adm.admit(n, priority=priority) as ticket:
        victims = []
        for _ in range(n):
            route = ticket.pick()
            v = Victim(priority)
            for w in route:
                if w is not None:
                    w.inflight.add(v)
            victims.append((route, v))
    return victims


def release(held) -> None:
    for route, v in held:
        for w in route:
            if w is not None:
                w.inflight.discard(v)


def test_capacity_is_twice_max_num_seqs_and_the_queue_admits_in_order():
    async def scenario() -> None:
        pool = pool_of(max_num_seqs=2)
        adm = admission(pool)
        held = await hold(adm, 4)  # 2 × max_num_seqs: full
        order: list[str] = []

        async def wait(name: str, n: int) -> None:
            got = await hold(adm, n)
            order.append(name)
            release(got)

        first = asyncio.create_task(wait("big", 2))
        await asyncio.sleep(0)
        second = asyncio.create_task(wait("small", 1))
        await asyncio.sleep(0.05)
        assert adm.queued == 2 and not order
        release(held[:1])  # room for one: the head needs two, so nobody overtakes it
        await asyncio.sleep(0.05)
        assert order == [] and adm.queued == 2
        release(held[1:])
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert order == ["big", "small"] and adm.queued == 0
        assert pool.of_role(Role.DECODE)[0].reserved == 0 and adm.stats.admitted == 3

    asyncio.run(scenario())


def test_no_room_within_the_bound_is_a_429_with_retry_after_and_a_full_queue_is_one_at_once():
    async def scenario() -> None:
        pool = pool_of(max_num_seqs=1)
        adm = admission(pool, max_queue=1, queue_timeout_s=0.3)
        await hold(adm, 2)
        waiting = asyncio.create_task(hold(adm))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as full:
            await hold(adm)
        assert full.value.status == 429 and full.value.retry_after_s == 2
        assert full.value.body()["error"]["code"] == "rate_limit_exceeded"
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(APIError) as late:
            await waiting
        assert late.value.status == 429 and loop.time() - started < 0.5
        assert adm.stats.rejected[Rejection.QUEUE_FULL] == 1 and adm.stats.rejected[Rejection.QUEUE_TIMEOUT] == 1
        assert adm.queued == 0

    asyncio.run(scenario())


def test_a_slow_worker_gets_no_new_requests_they_wait_for_it_and_a_dead_pool_is_a_503():
    async def scenario() -> None:
        clock = Clock()
        pool = pool_of(clock=clock)
        adm = admission(pool)
        decode = pool.of_role(Role.DECODE)[0]
        clock.t += 3.0
        pool.observe(decode, Probe(False, "unreachable"), asked_at=clock.t - 3.0)
        waiting = asyncio.create_task(hold(adm))
        await asyncio.sleep(0.05)
        assert adm.queued == 1 and not waiting.done()
        pool.observe(decode, Probe(True, "ok"))  # it answers again: the queued request runs there
        assert len(await asyncio.wait_for(waiting, 5)) == 1
        pool.observe(decode, Probe(False, "refused"))
        with pytest.raises(APIError) as e:
            await hold(adm)
        assert e.value.status == 503 and adm.stats.rejected[Rejection.NO_WORKER] == 1

    asyncio.run(scenario())


def test_queued_requests_get_their_503_when_the_last_worker_of_a_role_dies_not_at_the_bound():
    """Waiting helps only while a worker it could run on is alive or being restarted."""
    async def scenario() -> None:
        clock = Clock()
        pool = pool_of(clock=clock)
        adm = admission(pool, queue_timeout_s=30.0)
        prefill = pool.of_role(Role.PREFILL)[0]
        clock.t += 3.0
        pool.observe(prefill, Probe(False, "unreachable"), asked_at=clock.t - 3.0)  # slow: requests queue
        first, second = asyncio.create_task(hold(adm)), asyncio.create_task(hold(adm))
        await asyncio.sleep(0.05)
        assert adm.queued == 2
        pool.expect_back(prefill.url, True)  # it died and its supervisor restarts it: they wait
        await asyncio.sleep(0.05)
        assert adm.queued == 2 and not first.done()
        pool.expect_back(prefill.url, False)  # it will not be back
        for task in (first, second):
            with pytest.raises(APIError) as e:
                await asyncio.wait_for(task, 1.0)
            assert e.value.status == 503
        assert adm.queued == 0 and adm.stats.rejected[Rejection.NO_WORKER] == 2
        assert adm.stats.rejected[Rejection.QUEUE_TIMEOUT] == 0 and adm.stats.admitted == 0

    asyncio.run(scenario())


def test_a_client_that_leaves_the_queue_gives_back_its_place_and_reservations():
    async def scenario() -> None:
        pool = pool_of(max_num_seqs=1)
        adm = admission(pool)
        held = await hold(adm, 2)
        waiting = asyncio.create_task(hold(adm))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert adm.queued == 0
        release(held)
        assert all(w.reserved == 0 for w in pool.workers)

    asyncio.run(scenario())


def test_a_kv_pool_exhausted_with_requests_waiting_has_no_room():
    pool = pool_of(max_num_seqs=8)
    adm = admission(pool)
    decode = pool.of_role(Role.DECODE)[0]
    assert adm.has_room(decode)
    decode.load = Load(waiting=1, running=2, free_blocks=0, total_blocks=64)
    assert not adm.has_room(decode)


async def until(condition, turns: int = 1000) -> None:
    """Let the event loop run until `condition()` holds."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def test_priority_orders_the_queue_and_takes_the_place_of_a_larger_one_in_a_full_queue():
    """--scheduling-policy priority: a request goes before the waiting ones of a larger priority
    (arrival order among equals); in a full queue it takes the place of the last waiting one of a
    larger priority, which gets the 429; one of no smaller priority gets the 429 itself."""
    async def scenario() -> None:
        pool = pool_of(max_num_seqs=1)
        adm = admission(pool, max_queue=3, scheduling_policy="priority")
        held = await hold(adm, 2, -5)  # full, of a priority no later request passes
        order: list[str] = []

        async def wait(name: str, priority: int) -> None:
            got = await hold(adm, 1, priority)
            order.append(name)
            release(got)

        tasks = {}
        for name, priority in (("low", 5), ("mid", 1), ("low-2", 5)):
            tasks[name] = asyncio.create_task(wait(name, priority))
            await until(lambda: adm.queued == len(tasks))
        with pytest.raises(APIError) as same:  # no waiting request of a larger priority than 5
            await hold(adm, 1, 5)
        tasks["high"] = asyncio.create_task(wait("high", -1))
        await until(lambda: tasks["low-2"].done())
        assert same.value.status == 429 and tasks["low-2"].exception().status == 429
        assert adm.queued == 3 and adm.stats.rejected[Rejection.QUEUE_FULL] == 2
        release(held)
        await asyncio.wait_for(asyncio.gather(tasks["high"], tasks["mid"], tasks["low"]), 5)
        assert order == ["high", "mid", "low"] and adm.queued == 0

    asyncio.run(scenario())


def test_under_fcfs_the_queue_keeps_arrival_order_whatever_the_priority():
    async def scenario() -> None:
        pool = pool_of(max_num_seqs=1)
        adm = admission(pool)
        held = await hold(adm, 2)
        order: list[str] = []

        async def wait(name: str, priority: int) -> None:
            release(await hold(adm, 1, priority))
            order.append(name)

        tasks = []
        for name, priority in (("a", 5), ("b", -1)):
            tasks.append(asyncio.create_task(wait(name, priority)))
            await until(lambda: adm.queued == len(tasks))
        release(held)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert order == ["a", "b"]

    asyncio.run(scenario())


@pytest.mark.parametrize("policy,both", [("priority", 1), ("fcfs", 1), ("priority", 0), ("fcfs", 0)])
def test_a_smaller_priority_passes_a_worker_full_of_larger_ones(policy, both):
    """--scheduling-policy priority: a worker full of choices of priority 5 (its capacity, 2),
    colocated or a PD pair, still takes choices of priority -1, one for each of those (its
    scheduler preempts them for it, or runs it beside them), never more than its capacity
    again; a choice of priority 5 waits. Under fcfs nothing passes a full worker."""
    async def scenario() -> None:
        pool = pool_of(prefill=1 - both, decode=1 - both, both=both, max_num_seqs=1)
        adm = admission(pool, scheduling_policy=policy, queue_timeout_s=0.05)
        held = await hold(adm, 2, 5)  # full
        passed = []
        for _ in range(4):
            try:
                passed += await hold(adm, 1, -1)
            except APIError as e:
                assert e.status == 429
                break
        assert len(passed) == (2 if policy == "priority" else 0)
        with pytest.raises(APIError):
            await hold(adm, 1, 5)
        release(held + passed)

    asyncio.run(scenario())
