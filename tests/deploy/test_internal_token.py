"""configs/k8s: every pod that serves HTTP (the router, each worker's rank 0) reads the internal
API's token from one Secret, so the router and the workers share it (docs/liveness.md)."""
from __future__ import annotations

import pytest

from .tools import K8S, OVERLAYS, kustomize, pods


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_and_worker_leaders_take_the_internal_token_from_one_secret(overlay: str) -> None:
    docs = kustomize(K8S / "overlays" / overlay)
    serving = [p for p in pods(docs) if any(port.get("name") == "http" for port in p.container.get("ports", []))]
    assert {p.role for p in serving} >= {"router", "prefill", "decode"}
    refs = set()
    for pod in serving:
        (env,) = [e for e in pod.container.get("env", []) if e["name"] == "PDSERVE_INTERNAL_TOKEN"]
        ref = env["valueFrom"]["secretKeyRef"]
        refs.add((ref["name"], ref["key"]))
    assert len(refs) == 1, refs
