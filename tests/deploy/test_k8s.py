"""configs/k8s: every overlay renders with kustomize and validates offline, strictly, against
bundled Kubernetes schemas; what the schemas cannot say (CRDs, cross-object references, the
operational rules of issue 7) is checked here in Python."""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
import yaml

from .tools import (CRD_KINDS, K8S, K8S_VERSIONS, OVERLAYS, REPO, WORKER_COMPONENTS, Pod, arg_value,
                    kustomize, pods, quantity, validatable, validate)

DRAIN_MARGIN_S = 15          # grace period = preStop sleep + --drain-timeout + this
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}  # injected by LWS
GPU = "nvidia.com/gpu"
# The uid the image runs as (its last USER): the pods must run as the same one.
IMAGE_UID = int(re.findall(r"^USER (\d+)", (REPO / "Dockerfile").read_text(), re.M)[-1])


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: kustomize(K8S / "overlays" / name) for name in OVERLAYS}


def kinds(docs: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d["metadata"]["name"])
    return out


def one(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def env_config(docs: list[dict]) -> dict[str, str]:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("pdserve-env")]
    return cm["data"]


def api_pods(docs: list[dict]) -> list[Pod]:
    """Pods that serve HTTP (router, worker TP rank 0): those with a port named http."""
    return [p for p in pods(docs) if any(port.get("name") == "http" for port in p.container.get("ports", []))]


# ---------------------------------------------------------------- render and validate

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_router_workers_and_services(rendered, overlay: str) -> None:
    k = kinds(rendered[overlay])
    workload = "LeaderWorkerSet" if overlay == "rdma" else "Deployment"
    assert sorted(k[workload]) == (["pdserve-decode", "pdserve-prefill"] if workload == "LeaderWorkerSet"
                                   else ["pdserve-decode", "pdserve-prefill", "pdserve-router"])
    assert "pdserve-router" in k["Deployment"]
    assert sorted(k["Service"]) == ["pdserve", "pdserve-decode-headless", "pdserve-prefill-headless"]
    assert k["PersistentVolumeClaim"] == ["pdserve-models"]
    assert {d["metadata"].get("namespace") for d in rendered[overlay] if d["kind"] != "Namespace"} == {"pdserve"}
    # Plain Kubernetes only in cpu-test; the GPU overlays bring the PodMonitor and rules.
    monitoring = {"PodMonitor", "PrometheusRule"} <= set(k)
    assert monitoring == (overlay != "cpu-test")


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strict_offline(rendered, overlay: str, version: str, tmp_path: Path) -> None:
    docs = validatable(rendered[overlay])
    result = validate(docs, version, tmp_path)
    assert result.returncode == 0 and not result.errors, result.output
    expected = {f"{d['kind'].lower()}/{d['metadata']['name']}" for d in docs}
    assert set(result.passed) == expected, result.output
    # Only the CRDs lack a schema, and they are the ones checked structurally below.
    assert all(any(f"kind {k} " in w for k in CRD_KINDS) for w in result.warnings), result.output


def test_leaderworkerset_pod_templates_are_validated(rendered, tmp_path: Path) -> None:
    lws_pods = [p for p in pods(rendered["rdma"]) if p.owner["kind"] == "LeaderWorkerSet"]
    assert len(lws_pods) == 4  # leader and worker template of prefill and decode
    result = validate(validatable(rendered["rdma"]), K8S_VERSIONS[-1], tmp_path)
    wrapped = {r for r in result.passed if r.startswith("podtemplate/")}
    assert wrapped == {"podtemplate/pdserve-prefill-leadertemplate", "podtemplate/pdserve-prefill-workertemplate",
                       "podtemplate/pdserve-decode-leadertemplate", "podtemplate/pdserve-decode-workertemplate"}


def _break_unknown_field(docs: list[dict]) -> str:
    router = one(docs, "Deployment", "pdserve-router")
    router["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/health"
    return "deployment/pdserve-router"


def _break_wrong_type(docs: list[dict]) -> str:
    one(docs, "Service", "pdserve")["spec"]["ports"][0]["port"] = "eight thousand"
    return "service/pdserve"


def _break_lws_template(docs: list[dict]) -> str:
    lws = one(docs, "LeaderWorkerSet", "pdserve-decode")
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["resources"]["limit"] = {GPU: 4}
    return "podtemplate/pdserve-decode-workertemplate"


@pytest.mark.parametrize("overlay,breaker", [("cpu-test", _break_unknown_field),
                                             ("gpu-sm120", _break_wrong_type),
                                             ("rdma", _break_lws_template)])
def test_broken_manifest_fails_validation(rendered, overlay, breaker, tmp_path: Path) -> None:
    docs = copy.deepcopy(rendered[overlay])
    culprit = breaker(docs)
    result = validate(validatable(docs), K8S_VERSIONS[-1], tmp_path)
    assert result.returncode != 0
    assert len(result.errors) == 1 and culprit in result.errors[0], result.output


@pytest.mark.parametrize("rdma", [False, True], ids=["tcp", "rdma"])
@pytest.mark.parametrize("workers", WORKER_COMPONENTS)
def test_every_worker_component_composes_with_rdma_or_not(workers: str, rdma: bool, tmp_path: Path) -> None:
    """The overlays pick one combination each; the others must render and validate too."""
    components = [K8S / "components" / workers] + ([K8S / "components/rdma"] if rdma else [])
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": "pdserve", "resources": [os.path.relpath(K8S / "base", tmp_path)],
        "components": [os.path.relpath(c, tmp_path) for c in components]}))
    docs = kustomize(tmp_path)
    worker_pods = [p for p in pods(docs) if p.role != "router"]
    assert worker_pods and all(p.owner["kind"] == ("LeaderWorkerSet" if "leader" in workers else "Deployment")
                               for p in worker_pods)
    for p in worker_pods:
        limits = p.container["resources"]["limits"]
        assert ("rdma/rdma_shared_device_a" in limits) == rdma, p.name
        assert ("IPC_LOCK" in p.container["securityContext"]["capabilities"].get("add", [])) == rdma, p.name
    result = validate(validatable(docs), K8S_VERSIONS[-1], tmp_path)
    assert result.returncode == 0 and not result.errors, result.output


# ---------------------------------------------------------------- workloads

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_non_root_with_read_only_root_and_writable_caches(rendered, overlay: str) -> None:
    env = env_config(rendered[overlay])
    for p in pods(rendered[overlay]):
        sc = p.spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == IMAGE_UID, p.name
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", p.name
        assert p.spec.get("automountServiceAccountToken") is False, p.name
        csc = p.container["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False and csc["readOnlyRootFilesystem"] is True, p.name
        assert csc["capabilities"]["drop"] == ["ALL"], p.name
        added = csc["capabilities"].get("add", [])
        assert added == (["IPC_LOCK"] if overlay == "rdma" and p.role != "router" else []), p.name
        volumes = {v["name"]: v for v in p.spec["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in p.container["volumeMounts"]}
        assert "emptyDir" in mounts["/tmp"] and "emptyDir" in mounts["/cache"], p.name
        assert mounts["/models"]["persistentVolumeClaim"]["claimName"] == "pdserve-models", p.name
        for key in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "PDSERVE_CACHE_DIR"):
            assert any(env[key] == m or env[key].startswith(m + "/") for m in mounts), (p.name, key)
        assert all("hostPath" not in v for v in volumes.values()), p.name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_namespace_pod_security_level(rendered, overlay: str) -> None:
    (ns,) = [d for d in rendered[overlay] if d["kind"] == "Namespace"]
    level = ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    assert level == ("privileged" if overlay == "rdma" else "restricted")  # IPC_LOCK is beyond baseline


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_set_and_gpu_requests_equal_limits(rendered, overlay: str) -> None:
    for p in pods(rendered[overlay]):
        for c in p.spec["containers"]:
            req, lim = c["resources"]["requests"], c["resources"]["limits"]
            assert quantity(req["cpu"]) > 0 and quantity(req["memory"]) > 0, p.name
            assert quantity(lim["memory"]) >= quantity(req["memory"]), p.name
            for extended in (GPU, "rdma/rdma_shared_device_a"):
                assert req.get(extended) == lim.get(extended), (p.name, extended)
            gpus = int(lim.get(GPU, 0))
            wants_gpu = overlay != "cpu-test" and p.role != "router"
            assert (gpus > 0) == wants_gpu, p.name
            if gpus:  # Guaranteed QoS on GPU nodes
                assert req == lim, p.name
                assert p.spec["nodeSelector"]["nvidia.com/gpu.compute.major"] == "12", p.name
            else:
                assert "nodeSelector" not in p.spec and "tolerations" not in p.spec, p.name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dev_shm_is_memory_backed_and_bounded(rendered, overlay: str) -> None:
    for p in pods(rendered[overlay]):
        if p.role == "router":
            continue
        volumes = {v["name"]: v for v in p.spec["volumes"]}
        (shm,) = [volumes[m["name"]] for m in p.container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert shm["emptyDir"]["medium"] == "Memory", p.name
        size = quantity(shm["emptyDir"]["sizeLimit"])
        # Memory-backed: it counts against the container's memory limit.
        assert 0 < size < quantity(p.container["resources"]["limits"]["memory"]) / 2, p.name
        if overlay == "cpu-test":
            assert size <= 2**30


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tp_size_matches_gpus_and_group_size(rendered, overlay: str) -> None:
    for p in pods(rendered[overlay]):
        if p.role == "router":
            continue
        args = p.container["args"]
        assert args[0] == p.role
        tp = int(arg_value(args, "--tp"))
        gpus = int(p.container["resources"]["limits"].get(GPU, 0))
        if p.owner["kind"] == "LeaderWorkerSet":
            size = p.owner["spec"]["leaderWorkerTemplate"]["size"]
            assert size >= 2 and tp == gpus * size, p.name
            assert arg_value(args, "--nnodes") == "$(LWS_GROUP_SIZE)"
            assert arg_value(args, "--dist-init-addr").startswith("$(LWS_LEADER_ADDRESS):")
        else:
            assert tp == max(gpus, 1), p.name
        assert arg_value(args, "--device") == ("cpu" if overlay == "cpu-test" else "cuda")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_reference_is_defined(rendered, overlay: str) -> None:
    """`$(VAR)` in args is expanded by the kubelet only from the container's environment."""
    config = env_config(rendered[overlay])
    for p in pods(rendered[overlay]):
        c = p.container
        defined = {e["name"] for e in c.get("env", [])}
        if any("configMapRef" in e for e in c.get("envFrom", [])):
            defined |= set(config)
        if p.owner["kind"] == "LeaderWorkerSet":
            defined |= LWS_ENV
        used = {v for a in c["args"] for v in re.findall(r"\$\((\w+)\)", a)}
        assert used <= defined, (p.name, used - defined)
        if p.role != "router":
            by_name = {e["name"]: e for e in c["env"]}
            assert by_name["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", p.name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_envfrom_points_at_the_generated_configmap(rendered, overlay: str) -> None:
    (cm,) = [d["metadata"]["name"] for d in rendered[overlay] if d["kind"] == "ConfigMap"]
    assert re.fullmatch(r"pdserve-env-[a-z0-9]{10}", cm)  # hashed: a change rolls the pods
    for p in pods(rendered[overlay]):
        refs = [e["configMapRef"]["name"] for e in p.container["envFrom"]]
        assert refs == [cm], p.name
        assert p.container["image"] == "pdserve:0.1.0", p.name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ucx_and_nccl_settings_come_from_the_environment(rendered, overlay: str) -> None:
    env = env_config(rendered[overlay])
    tls = env["UCX_TLS"].split(",")
    assert env["UCX_NET_DEVICES"]
    if overlay == "rdma":
        assert "rc" in tls and "tcp" not in tls and "cuda_copy" in tls
        assert env["UCX_NET_DEVICES"].startswith("mlx5") and env["NCCL_IB_HCA"]
    else:
        assert "tcp" in tls and "rc" not in tls
        assert ("cuda_copy" in tls) == (overlay == "gpu-sm120")
    assert env["PDSERVE_MODEL"] == ("default" if overlay == "cpu-test" else "/models/model")


# ---------------------------------------------------------------- probes and lifecycle

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_startup_liveness_readiness(rendered, overlay: str) -> None:
    for p in pods(rendered[overlay]):
        c = p.container
        ports = {port["name"]: port["containerPort"] for port in c.get("ports", [])}
        if p.which == "workerTemplate":  # LWS nodes > 0: no worker API, only the follower's probes
            assert ports == {"health": int(arg_value(c["args"], "--port"))}, p.name
            assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "health"}, p.name
            assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "health"}, p.name
            assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "health"}, p.name
            live = c["livenessProbe"]
            assert live["periodSeconds"] * live["failureThreshold"] <= 60, p.name
            assert live["terminationGracePeriodSeconds"] <= 30
            continue
        assert all(port.get("name") for port in c["ports"]), p.name
        assert c["startupProbe"]["httpGet"]["port"] == "http"
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}, p.name
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}, p.name
        startup = c["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        assert budget >= (600 if p.role == "router" else 1800), p.name  # model load
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] <= 60, p.name
        # A wedged pod is killed quickly, not after the long drain grace period.
        assert live["terminationGracePeriodSeconds"] <= 30
        assert int(arg_value(c["args"], "--port")) == ports["http"], p.name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_matches_drain_timeout(rendered, overlay: str) -> None:
    for p in pods(rendered[overlay]):
        c = p.container
        drain = int(arg_value(c["args"], "--drain-timeout"))
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert p.spec["terminationGracePeriodSeconds"] == pre_stop + drain + DRAIN_MARGIN_S, p.name
        if p.role != "router":
            assert int(arg_value(c["args"], "--health-stall-timeout")) > 0


def test_router_api_key_is_optional_secret(rendered) -> None:
    for docs in rendered.values():
        (router,) = [p for p in pods(docs) if p.role == "router"]
        (key,) = [e for e in router.container["env"] if e["name"] == "PDSERVE_API_KEY"]
        ref = key["valueFrom"]["secretKeyRef"]
        assert ref["optional"] is True and ref["name"] == "pdserve-api-key"
        assert not [d for d in docs if d["kind"] == "Secret"]  # never a key in the repo


# ---------------------------------------------------------------- services and discovery

def selects(selector: dict, pod: Pod) -> bool:
    return all(pod.labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_headless_services_select_exactly_rank0_pods_of_their_role(rendered, overlay: str) -> None:
    docs = rendered[overlay]
    all_pods = list(pods(docs))
    router = [p for p in all_pods if p.role == "router"][0]
    for role in ("prefill", "decode"):
        svc = one(docs, "Service", f"pdserve-{role}-headless")
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
        chosen = [p for p in all_pods if selects(svc["spec"]["selector"], p)]
        expected = [p for p in all_pods if p.role == role and p.which != "workerTemplate"]
        assert chosen == expected and chosen, (role, [p.name for p in chosen])
        (port,) = svc["spec"]["ports"]
        for p in chosen:
            assert {"name": "http", "containerPort": port["port"], "protocol": "TCP"} in p.container["ports"]
        assert arg_value(router.container["args"], f"--discover-{role}") == f"{svc['metadata']['name']}:{port['port']}"
    svc = one(docs, "Service", "pdserve")
    assert [p for p in all_pods if selects(svc["spec"]["selector"], p)] == [router]


@pytest.mark.parametrize("overlay", ["gpu-sm120", "rdma"])
def test_podmonitor_scrapes_every_http_pod(rendered, overlay: str) -> None:
    docs = rendered[overlay]
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    selector = pm["spec"]["selector"]["matchLabels"]
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and re.fullmatch(r"\d+s", endpoint["interval"])
    scraped = [p for p in pods(docs) if selects(selector, p)
               and any(port.get("name") == endpoint["port"] for port in p.container.get("ports", []))]
    assert {p.name for p in scraped} == {p.name for p in api_pods(docs)}
    assert {p.role for p in scraped} == {"router", "prefill", "decode"}


@pytest.mark.parametrize("overlay", ["gpu-sm120", "rdma"])
def test_prometheus_rules_are_well_formed(rendered, overlay: str) -> None:
    (rule,) = [d for d in rendered[overlay] if d["kind"] == "PrometheusRule"]
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert len(alerts) >= 8
    for a in alerts:
        assert set(a) <= {"alert", "expr", "for", "labels", "annotations"}, a
        assert re.fullmatch(r"Pdserve[A-Za-z]+", a["alert"]) and "pdserve:" in a["expr"]
        assert a["labels"]["severity"] in ("critical", "warning", "info")
        assert a["expr"].count("(") == a["expr"].count(")")
        assert re.fullmatch(r"\d+[smh]", a["for"])


# ---------------------------------------------------------------- LeaderWorkerSet

def test_leaderworkerset_structure(rendered) -> None:
    for lws in [d for d in rendered["rdma"] if d["kind"] == "LeaderWorkerSet"]:
        assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        spec = lws["spec"]
        assert set(spec) <= {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy",
                             "networkConfig"}
        assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
        assert spec["startupPolicy"] in ("LeaderCreated", "LeaderReady")
        roll = spec["rolloutStrategy"]
        assert roll["type"] == "RollingUpdate"
        assert set(roll["rollingUpdateConfiguration"]) <= {"partition", "maxUnavailable", "maxSurge"}
        lwt = spec["leaderWorkerTemplate"]
        assert set(lwt) <= {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy",
                            "volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy"}
        # A rank that restarts alone could never rejoin the group's collectives.
        assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
        leader = lwt["leaderTemplate"]["spec"]["containers"][0]
        worker = lwt["workerTemplate"]["spec"]["containers"][0]
        assert arg_value(leader["args"], "--node-rank") == "0"
        assert arg_value(worker["args"], "--node-rank") == "$(NODE_RANK)"
        (rank,) = [e for e in worker["env"] if e["name"] == "NODE_RANK"]
        assert rank["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"
        assert {"name": "dist", "containerPort": 29500, "protocol": "TCP"} in leader["ports"]
        # Leader and workers differ only where they must.
        def same(c: dict) -> dict:
            return {k: v for k, v in c.items() if k not in ("args", "env", "ports") and "Probe" not in k}
        assert same(leader) == same(worker)
        assert [a for a in leader["args"] if not a.startswith("--node-rank")] == \
            [a for a in worker["args"] if not a.startswith("--node-rank")]


# ---------------------------------------------------------------- the commands themselves

def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """`$(VAR)` in container args as the kubelet expands them (unknown ones stay as they are)."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), a) for a in args]


def pod_env(pod: Pod, config: dict[str, str]) -> dict[str, str]:
    """Example values of a pod's environment: the ConfigMap, the downward API, LeaderWorkerSet's."""
    env = dict(config, POD_NAME=f"{pod.owner['metadata']['name']}-0", POD_IP="10.1.2.3")
    if pod.owner["kind"] == "LeaderWorkerSet":
        size = pod.owner["spec"]["leaderWorkerTemplate"]["size"]
        env |= {"LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(size - 1), "NODE_RANK": str(size - 1),
                "LWS_LEADER_ADDRESS": f"{pod.owner['metadata']['name']}-0.{pod.owner['metadata']['name']}.pdserve"}
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_command_parses_with_the_pdserve_cli(rendered, overlay: str) -> None:
    """Every flag the manifests give exists and their values fit together, as `pdserve.cli`'s own
    parser and the workers' settings (TP size, nodes, node rank, rendezvous) see them once the
    kubelet expanded the `$(VAR)`s; router and workers name the model alike, so their metrics
    carry one `model_name`."""
    from pdserve.cli import build_parser
    from pdserve.model_name import served_name
    from pdserve.worker.main import worker_settings

    parser = build_parser()
    config = env_config(rendered[overlay])
    names = set()
    for p in pods(rendered[overlay]):
        args = parser.parse_args(expand(p.container["args"], pod_env(p, config)))
        assert args.command == p.role, p.name
        names.add(served_name(args.model, args.served_model_name)[0])
        if p.role == "router":
            assert args.discover_prefill and args.discover_decode and args.log_json and args.drain_timeout > 0
            continue
        settings = worker_settings(args, p.role)
        if p.owner["kind"] == "LeaderWorkerSet":
            size = p.owner["spec"]["leaderWorkerTemplate"]["size"]
            assert (settings.nnodes, settings.layout.leader) == (size, p.which == "leaderTemplate"), p.name
            assert settings.layout.per_node == int(p.container["resources"]["limits"][GPU]), p.name
            assert settings.rendezvous[1] == 29500 and settings.dist_init_timeout >= 600, p.name
        else:
            assert settings.nnodes == 1, p.name
    assert len(names) == 1, names


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_restarted_pod_heals_and_a_crash_loop_says_why(rendered, overlay: str) -> None:
    """Issue 20 in the cluster: the kubelet restarts a failed container (a TP group's pods as one
    group), its worker rejoins through discovery; a crash-looping container's one-line start-up
    error is its termination message; workers give up the requests of a router that stopped
    calling them after a bounded lease; liveness and readiness probe /health and /ready."""
    from pdserve.cli import build_parser

    parser = build_parser()
    config = env_config(rendered[overlay])
    for p in pods(rendered[overlay]):
        assert p.container.get("terminationMessagePolicy") == "FallbackToLogsOnError", p.name
        assert p.spec.get("restartPolicy", "Always") == "Always", p.name
        if p.owner["kind"] == "LeaderWorkerSet":
            assert p.owner["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart", p.name
        args = parser.parse_args(expand(p.container["args"], pod_env(p, config)))
        if p.role != "router":
            assert 0 < args.router_lease <= 60, p.name
        if p in api_pods(rendered[overlay]):
            assert p.container["livenessProbe"]["httpGet"]["path"] == "/health", p.name
            assert p.container["readinessProbe"]["httpGet"]["path"] == "/ready", p.name
