"""Supervision without processes: the restart decision (policy, backoff, crash loop), the
worker's last error as one line, the router's pool while a worker is restarted (requests wait
for it, then 503), and the start-up checks on a model's config alone."""
from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from pdserve.frontend.admission import Admission, AdmissionConfig, Rejection
from pdserve.frontend.errors import APIError
from pdserve.frontend.worker_client import Probe
from pdserve.preflight import ConfigError, Settings, check, check_argv
from pdserve.supervisor import History, RestartPolicy, Supervision, decide, describe_exit, last_error
from pdserve.worker_api import Info, Role

from tests.frontend.test_admission import Victim, pool_of


# ---- the decision ---------------------------------------------------------------------------------


def test_on_failure_restarts_a_crash_or_a_kill_but_not_a_clean_exit():
    s = Supervision(RestartPolicy.ON_FAILURE)
    assert decide(s, 1, 0.0, 100.0, History()).restart
    assert decide(s, -9, 0.0, 100.0, History()).restart
    assert not decide(s, 0, 0.0, 100.0, History()).restart
    assert decide(Supervision(RestartPolicy.ALWAYS), 0, 0.0, 100.0, History()).restart
    assert not decide(Supervision(RestartPolicy.NEVER), 1, 0.0, 100.0, History()).restart


def test_backoff_doubles_while_the_worker_keeps_failing_and_starts_over_once_it_ran():
    s = Supervision(backoff_s=0.5, max_backoff_s=3.0, max_restarts=100, window_s=1.0, stable_after_s=30.0)
    h = History()
    delays = []
    for k in range(5):
        now = 10.0 * k
        delays.append(decide(s, 1, now - 1.0, now, h).delay_s)  # each ran 1 s
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert decide(s, 1, 100.0, 200.0, h).delay_s == 0.5  # it ran 100 s: stable, start over


def test_more_exits_than_the_bound_within_the_window_is_a_crash_loop():
    s = Supervision(max_restarts=3, window_s=60.0)
    h = History()
    assert [decide(s, 1, t - 1, t, h).restart for t in (100.0, 101.0, 102.0)] == [True] * 3
    d = decide(s, 1, 102.5, 103.0, h)
    assert not d.restart and d.crash_loop
    h2 = History()
    assert all(decide(s, 1, t - 1, t, h2).restart for t in (0.0, 70.0, 140.0, 210.0, 280.0))  # spread out


def test_the_last_error_is_the_workers_own_line():
    tail = ["2026-12-02 05:00:00,000 INFO pdserve.worker.main: loading",
            "Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
            "RuntimeError: 9 attention heads do not split over TP size 2", ""]
    assert last_error(tail) == "RuntimeError: 9 attention heads do not split over TP size 2"
    assert last_error(["pdserve prefill: error: --model /m: the model directory /m does not exist"]) == \
        "pdserve prefill: error: --model /m: the model directory /m does not exist"
    record = json.dumps({"component": "decode", "level": "ERROR", "message": "rank 1 stops: connection reset\nmore"})
    assert last_error(["{not json", record]) == "rank 1 stops: connection reset"
    assert last_error(["2026-12-02 05:00:00,000 INFO pdserve.x: no error here", "all fine"]) is None
    assert last_error(["2026-12-02 05:00:00,000 ERROR pdserve.worker.runtime: rank 0 stops: peer gone"]) == \
        "rank 0 stops: peer gone"
    assert describe_exit(-9) == "was killed by SIGKILL" and describe_exit(3) == "exited with code 3"


# ---- the router while a worker restarts -----------------------------------------------------------


def test_a_worker_being_restarted_is_out_of_rotation_but_recovering():
    pool = pool_of()
    prefill = pool.of_role(Role.PREFILL)[0]
    victim = Victim()
    prefill.inflight.add(victim)
    pool.expect_back(prefill.url, True)
    assert not pool.ready and pool.recovering and len(victim.errors) == 1  # its process is gone
    prefill.info = Info(role=Role.PREFILL, worker_id="p-new", model="m", max_model_len=2048, block_size=16,
                        num_blocks=64, tp=1, eos_token_ids=[2], max_num_seqs=2)
    pool.observe(prefill, Probe(True, "ok"))
    assert pool.ready and not prefill.restarting
    pool.expect_back(prefill.url, False)
    assert not pool.ready and not pool.recovering


def test_discovered_roles_are_recovering_while_their_pods_come_back():
    pool = pool_of(prefill=0)
    assert not pool.ready and not pool.recovering
    pool.orchestrated = {Role.PREFILL}  # the router discovers prefill workers: the kubelet restarts them
    assert not pool.ready and pool.recovering


def test_a_request_waits_for_a_restarting_worker_then_runs():
    async def main() -> None:
        pool = pool_of()
        adm = Admission(pool, AdmissionConfig(max_queue=4, queue_timeout_s=5.0))
        prefill = pool.of_role(Role.PREFILL)[0]
        pool.expect_back(prefill.url, True)
        async def admitted():
            async with adm.admit(1) as ticket:
                return ticket.pick()

        waiting = asyncio.create_task(admitted())
        await asyncio.sleep(0.05)
        assert not waiting.done() and adm.queued == 1
        prefill.info = Info(role=Role.PREFILL, worker_id="p-new", model="m", max_model_len=2048, block_size=16,
                            num_blocks=64, tp=1, eos_token_ids=[2], max_num_seqs=2)
        pool.observe(prefill, Probe(True, "ok"))  # its first good probe wakes the queue
        route = await asyncio.wait_for(waiting, 1.0)
        assert route.prefill is prefill

    asyncio.run(main())


def test_a_restart_that_outlasts_the_queue_bound_is_a_503_not_a_429():
    async def main() -> None:
        pool = pool_of()
        adm = Admission(pool, AdmissionConfig(max_queue=4, queue_timeout_s=0.2))
        pool.expect_back(pool.of_role(Role.DECODE)[0].url, True)
        with pytest.raises(APIError) as e:
            async with adm.admit(1):
                pass
        assert e.value.status == 503 and adm.stats.rejected[Rejection.NO_WORKER] == 1

    asyncio.run(main())


# ---- start-up checks ------------------------------------------------------------------------------


def _model(tmp_path: Path, **cfg) -> str:
    base = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 9, "num_key_value_heads": 3,
            "hidden_size": 576, "head_dim": 64, "num_hidden_layers": 30}
    (tmp_path / "config.json").write_text(json.dumps({**base, **cfg}))
    return str(tmp_path)


def test_tp_must_split_the_heads(tmp_path):
    model = _model(tmp_path)
    with pytest.raises(ConfigError, match=r"--tp 2 does not divide the 9 attention heads"):
        check(Settings(model=model, tp=2))
    check(Settings(model=model, tp=3))
    check(Settings(model=model, tp=9))  # 3 KV heads replicated over 9 ranks
    with pytest.raises(ConfigError, match="4 KV heads"):
        check(Settings(model=_model(tmp_path, num_attention_heads=12, num_key_value_heads=4), tp=6))


def test_a_missing_model_a_busy_port_and_a_pool_without_a_block_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        check(Settings(model=str(tmp_path / "nope")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"{port} is already in use"):
            check(Settings(model=_model(tmp_path), host="127.0.0.1", port=port))
    with pytest.raises(ConfigError, match="holds no KV block"):
        check(Settings(model=_model(tmp_path), kv_cache_memory=1024))
    with pytest.raises(ConfigError, match=r"--max-model-len 8192 does not fit the KV pool \(22 blocks"):
        check(Settings(model=_model(tmp_path), kv_cache_memory=16 << 20, max_model_len=8192))


def test_a_bound_port_is_held_from_anyone_who_picks_a_free_port():
    from pdserve.ports import free_port
    from pdserve.preflight import bind_port

    port = free_port()
    held = bind_port("127.0.0.1", port)
    try:  # what free_port tries for a TP rendezvous or a worker: refused while a worker holds it
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", port))
    finally:
        held.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free again once the holder closes it


def test_a_workers_connections_have_nagle_off():
    """uvicorn serves a worker on its held socket through asyncio, which sets TCP_NODELAY only on
    connections of a socket that says it is TCP. With Nagle on, every keep-alive answer's body
    waited ≈ 40 ms behind its headers for the caller's delayed ACK (/health, /load, /abort)."""
    from pdserve.ports import free_port
    from pdserve.preflight import bind_port

    async def accepted_nodelay() -> int:
        sock = bind_port("127.0.0.1", free_port())
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader, writer) -> None:
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            value = await asyncio.wait_for(seen, 10)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) == 1


def test_check_argv_reads_only_what_it_needs(tmp_path):
    model = _model(tmp_path)
    assert check_argv(["--log-level", "INFO", "decode", "--model", model, "--tp", "2"]).startswith(
        "pdserve decode: error: --tp 2 does not divide the 9 attention heads")
    assert check_argv(["generate", "--model", str(tmp_path / "nope"), "hi"]) is None  # not a serving command
    assert check_argv(["serve", "--model", model, "--port", "0", "--worker-arg=--tp=2"]) is None


def test_the_router_lease_runs_out_only_without_router_calls():
    from pdserve.worker.lease import RouterLease

    now = [0.0]
    lease = RouterLease(5.0, clock=lambda: now[0])
    now[0] = 4.9
    assert not lease.expired()
    lease.renew()  # a /load probe
    now[0] = 9.8
    assert not lease.expired()
    now[0] = 9.9
    assert lease.expired() and lease.silence() == pytest.approx(5.0)
    off = RouterLease(0.0, clock=lambda: now[0])
    now[0] = 1e9
    assert not off.enabled and not off.expired()


# ---- a dead worker's peers are told (issue 20: its rooms fail within 2 s) --------------------------


def _info(role: Role, worker_id: str, incarnation: str) -> Info:
    return Info(role=role, worker_id=worker_id, model="m", max_model_len=2048, block_size=16, num_blocks=64,
                tp=1, eos_token_ids=[2], max_num_seqs=2, incarnation=incarnation)


class Notices:
    """The worker calls of the pool, answered from `infos` (URL → its /info now), and the
    /peers/dead notices it sends, recorded as (URL, body)."""

    def __init__(self, infos: dict[str, Info]) -> None:
        self.infos, self.sent = infos, []

    async def health(self, url: str, timeout_s: float) -> Probe:
        return Probe(True, "ok", 1)

    async def info(self, url: str, timeout_s: float) -> Info:
        return self.infos[url]

    async def load(self, url: str, timeout_s: float) -> None:
        return None

    async def peer_dead(self, url: str, body, timeout_s: float) -> int:
        self.sent.append((url, body))
        return 1


def test_the_peers_of_a_dead_worker_hear_which_process_died():
    from pdserve.frontend.workers import WorkerPool

    async def run() -> None:
        infos = {"http://p:1": _info(Role.PREFILL, "p", "inc-1"), "http://d0:1": _info(Role.DECODE, "d0", "x"),
                 "http://d1:1": _info(Role.DECODE, "d1", "y")}
        client = Notices(infos)
        pool = WorkerPool(client, ["p:1"], ["d0:1", "d1:1"], [])
        await pool.probe_all()
        prefill = pool.of_role(Role.PREFILL)[0]
        pool.expect_back(prefill.url, True)  # its supervisor saw it exit: /info is forgotten, not who it was
        assert prefill.info is None
        await pool.peer_dead(prefill.url, "the prefill worker was killed by SIGKILL")
        assert sorted(url for url, _ in client.sent) == ["http://d0:1", "http://d1:1"]  # the decode side only
        body = client.sent[0][1]
        assert (body.worker_id, body.incarnation, body.reason) == ("p", "inc-1", "the prefill worker was killed by SIGKILL")
        # restarted with the same worker id (a container restart): a new incarnation at its URL
        # is proof the old process is gone, and the notice names the old one
        client.sent.clear()
        infos["http://p:1"] = _info(Role.PREFILL, "p", "inc-2")
        await pool.probe(prefill)
        await asyncio.gather(*pool._notices)
        assert [(b.worker_id, b.incarnation) for _, b in client.sent] == [("p", "inc-1")] * 2
        client.sent.clear()
        pool.observe(prefill, Probe(False, "refused"))  # a refused port alone is not proof: no notice
        await pool.probe(prefill)  # the same process answers again
        assert client.sent == []

    asyncio.run(run())


def test_a_notice_picks_the_rooms_of_the_dead_process_only():
    from pdserve.worker.peers import PeerRooms

    clock = [0.0]
    rooms = PeerRooms(keep_s=60.0, clock=lambda: clock[0])
    rooms.add("a", "p", "inc-1")
    rooms.add("b", "p", "inc-2")   # its restarted successor, same worker id
    rooms.add("c", "p", None)      # the router did not say which process: taken as the dead one's
    rooms.add("d", "q", "inc-1")
    rooms.add("e", "p", "inc-1")
    rooms.ended("e")
    clock[0] = 30.0
    assert rooms.take("p", "inc-1") == ["a", "c", "e"]  # an ended room may hold blocks until fenced
    assert rooms.take("p", "inc-1") == []  # settled: a repeated notice finds nothing
    assert rooms.take("p", None) == ["b"]
    rooms.add("f", "q", "inc-1")
    rooms.ended("f")
    clock[0] = 91.0
    assert rooms.take("q", "inc-1") == ["d"] and len(rooms) == 0  # "f" ended more than keep_s ago


def test_the_supervisor_waits_until_no_rank_of_a_dead_worker_is_left(tmp_path):
    """A worker whose rank 0 exited while a rank it spawned lives on (here: ignores SIGTERM):
    `end_group` kills the rest of its process group and returns once none is alive."""
    import subprocess
    import sys

    from pdserve.launcher import Child, end_group, group_members

    script = ("import os, signal, subprocess, sys, time\n"
              "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
              "print('ready', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"ready"
    proc.wait(timeout=10)  # rank 0 is gone; its rank is not
    assert len(group_members(proc.pid)) == 1
    assert end_group(Child("prefill", "http://127.0.0.1:1", proc), timeout_s=5.0)
    assert group_members(proc.pid) == []
