"""Multi-node tensor parallelism on loopback: a TP group over 2 "nodes" (separate `pdserve
worker` processes joined with --nnodes/--node-rank/--dist-init-addr, as the LeaderWorkerSet pods
are) gives the greedy tokens of TP=1, colocated (TP=4: two ranks per node, one of them a child
process) and PD (TP=2); node 1 serves only its probes and exits with node 0; flags that do not
fit together are refused."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from pdserve.cli import main as pdserve_main
from pdserve.distributed.layout import TPLayout, parse_addr

from .conftest import WorkerProc, free_port, pool_full, start_worker, wait_for
from .test_tp import PROMPTS, assert_equal_greedy, reference, run_all

NODE_EXIT_S = 20  # node 0 gone or stopped: how long node 1 may take to notice and exit


def two_node_group(role: str, model: str, tp: int) -> tuple[WorkerProc, WorkerProc]:
    """Node 0 (rank 0, the API) and node 1 (ranks tp/2..tp-1) of one TP group; each has its own
    --worker-id, as pods do."""
    addr = f"127.0.0.1:{free_port()}"
    group = ("--tp", str(tp), "--nnodes", "2", "--dist-init-addr", addr)
    node1 = start_worker(role, model, *group, "--node-rank", "1", wait=False)
    try:
        node0 = start_worker(role, model, *group, "--node-rank", "0")
        wait_for(lambda: node1.get("/ready").status_code == 200, 10, "node 1 ready")
    except BaseException:
        node1.kill()
        raise
    return node0, node1


def exits(w: WorkerProc, timeout: float = NODE_EXIT_S) -> int:
    code = w.proc.wait(timeout=timeout)
    wait_for(lambda: os.popen(f"pgrep -g {w.proc.pid}").read().split() == [], 10, f"no process of {w.role} left")
    return code


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_two_node_group_colocated_equals_tp1_and_stops_with_node0(tiny_llama4_dir):
    ref = reference(tiny_llama4_dir, PROMPTS)
    node0, node1 = two_node_group("both", tiny_llama4_dir, tp=4)
    try:
        assert_equal_greedy(tiny_llama4_dir, PROMPTS, run_all(None, node0, PROMPTS, "mn"), ref)
        health = node1.get("/health")
        assert health.status_code == 200
        assert health.json() | {"step": 0, "seconds_since_step": 0} == {
            "status": "ok", "role": "both", "node_rank": 1, "ranks": [2, 3], "step": 0, "seconds_since_step": 0}
        assert health.json()["step"] > 0
        assert node1.get("/info").status_code == 404  # no worker API on node 1
        assert node0.get("/info").json()["tp"] == 4
        os.killpg(node0.proc.pid, signal.SIGTERM)  # node 0 drains, then its plan stops node 1
        assert exits(node0) == 0
        assert exits(node1) == 0
    finally:
        node0.kill()
        node1.kill()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_two_node_groups_pd_equal_tp1_and_a_dead_node0_takes_node1_down(tiny_llama4_dir):
    ref = reference(tiny_llama4_dir, PROMPTS)
    prefill0, prefill1 = two_node_group("prefill", tiny_llama4_dir, tp=2)
    try:
        decode0, decode1 = two_node_group("decode", tiny_llama4_dir, tp=2)
    except BaseException:
        prefill0.kill()
        prefill1.kill()
        raise
    nodes = (prefill0, prefill1, decode0, decode1)
    try:
        # Rank i of prefill writes into rank i of decode, which knows its writer by the name
        # agent_name(prefill worker id, i): every rank's agent is named after node 0's worker id.
        agents = [json.loads(b)["agent"] for b in decode0.get("/bootstrap").json()["ranks"]]
        assert agents == [f"pdserve-decode-{decode0.worker_id}-tp{i}" for i in (0, 1)]
        assert_equal_greedy(tiny_llama4_dir, PROMPTS, run_all(prefill0, decode0, PROMPTS, "mnpd"), ref)
        wait_for(lambda: pool_full(prefill0) and pool_full(decode0), 20, "pools full")
        t0 = time.monotonic()
        prefill0.kill()  # SIGKILL: node 1's next collective fails
        assert exits(prefill1) != 0
        assert time.monotonic() - t0 < NODE_EXIT_S
        os.killpg(decode0.proc.pid, signal.SIGTERM)
        assert exits(decode0) == 0
        assert exits(decode1) == 0
    finally:
        for w in nodes:
            w.kill()


def ipv4_interface() -> tuple[str, str] | None:
    """(name, address) of an up interface other than loopback, if this machine has one."""
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        return name, socket.inet_ntoa(raw[20:24])
    return None


AGENT_ADDRESS = """
import socket, sys, torch
from pdserve.transfer.layout import PoolLayout
from pdserve.transfer.nixl_backend import NixlEndpoint
ep = NixlEndpoint("probe", PoolLayout.of([torch.zeros(2, 4096, dtype=torch.uint8)]))
print(socket.inet_aton(sys.argv[1]) in ep.metadata)
ep.close()
"""


def test_transfer_bootstrap_carries_the_address_of_ucx_net_devices():
    """Why follower nodes need no address flag: a rank's NIXL metadata (in its bootstrap) holds
    the address of the interface UCX_NET_DEVICES names on its own machine (a pod's eth0)."""
    iface = ipv4_interface()
    if iface is None:
        pytest.skip("no IPv4 interface besides loopback")
    env = dict(os.environ, UCX_NET_DEVICES=iface[0], UCX_TLS="tcp,self")
    r = subprocess.run([sys.executable, "-c", AGENT_ADDRESS, iface[1]], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.splitlines()[-1:] == ["True"], (iface, r.stdout, r.stderr[-2000:])  # NIXL logs there too


def test_group_layout_puts_consecutive_ranks_on_each_node():
    assert [list(TPLayout(8, 2, r).children) for r in (0, 1)] == [[1, 2, 3], [5, 6, 7]]
    assert [TPLayout(8, 2, r).first for r in (0, 1)] == [0, 4]
    assert TPLayout(2, 2, 1).children == range(2, 2) and TPLayout(4).children == range(1, 4)
    assert parse_addr("pdserve-decode-0.pdserve-decode:29500") == ("pdserve-decode-0.pdserve-decode", 29500)
    assert parse_addr("[::1]:29500") == ("::1", 29500)
    # one GPU per local rank: node 1's global ranks 4..7 use its cuda:0..3
    assert [TPLayout(8, 2, 1).device("cuda", r) for r in range(4, 8)] == [f"cuda:{i}" for i in range(4)]
    assert TPLayout(8, 2, 1).device("cuda:2", 5) == "cuda:2" and TPLayout(2).device("cpu", 1) == "cpu"


@pytest.mark.parametrize("argv, words", [
    (["worker", "--tp", "4", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"],
     ["--node-rank 2", "--nnodes 2"]),
    (["decode", "--tp", "2", "--nnodes", "2", "--node-rank", "1"], ["--dist-init-addr"]),
    (["prefill", "--tp", "2", "--nnodes", "2", "--dist-init-addr", "no-port"], ["HOST:PORT", "no-port"]),
])
def test_multi_node_flags_that_do_not_fit_are_refused(argv, words, capsys):
    assert pdserve_main(argv) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_serve_refuses_multi_node_flags(capsys):
    with pytest.raises(SystemExit) as e:
        pdserve_main(["serve", "--nnodes", "2"])
    assert e.value.code == 2
    assert "--nnodes is a flag of `pdserve prefill | decode | worker`" in capsys.readouterr().err


def test_tp_not_divisible_by_nnodes_exits_nonzero_naming_both():
    """The command as a process: before any model load, an error that names both numbers."""
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "worker", "--tp", "3", "--nnodes", "2",
                        "--node-rank", "0", "--dist-init-addr", f"127.0.0.1:{free_port()}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--tp 3 is not divisible by --nnodes 2" in r.stderr, r.stderr
