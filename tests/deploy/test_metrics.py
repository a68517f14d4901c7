"""pdserve/metrics.py: the router's and the workers' /metrics parse with the Prometheus text
parser and count what was done; the Grafana dashboard and the alert rules use only metrics
that exist, and the dashboard shows every one of them."""
from __future__ import annotations

import json
import re

import prometheus_client
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.metrics import ABORT_ORIGINS, FINISH_REASONS, RouterMetrics, WorkerMetrics

from .tools import K8S, REPO

DASHBOARD = REPO / "configs/grafana/pdserve.json"
RULES = K8S / "components/monitoring/prometheusrule.yaml"

# The names issue 7 and vLLM's conventions ask for (without the `pdserve:` namespace).
EXPECTED = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge",
    "kv_blocks_used": "gauge", "kv_blocks_total": "gauge", "kv_cache_usage_perc": "gauge",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram", "request_decode_time_seconds": "histogram",
    "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
    "rooms": "counter", "kv_transfer_seconds": "histogram", "kv_transfer_bytes": "counter",
    "kv_transfer_failures": "counter", "aborts": "counter", "late_messages_dropped": "counter",
    # the transfer's own view, which the PD fault tests read to prove a transfer was in flight
    "kv_rooms_live": "gauge", "kv_writes_in_flight": "gauge", "kv_rooms_failed_peer_dead": "counter",
    "scheduler_step_seconds": "histogram", "scheduler_agree_seconds": "histogram",
    # the prefix cache (issue 15) and preemptions (issue 18)
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter", "prefix_cache_host_hits": "counter",
    "kv_blocks_cached": "gauge", "prefix_cache_evictions": "counter", "host_cache_blocks_used": "gauge",
    "host_cache_blocks_total": "gauge", "host_cache_drops": "counter", "prefix_cache_forgotten_blocks": "counter",
    "num_preemptions": "counter",
    # waits for a finished request's next turn (docs/follow-ups.md)
    "follow_up_waits": "counter", "follow_up_wait_seconds": "counter",
    "parser_diagnostics": "counter",
    # structured outputs (issue 19)
    "grammar_cache_lookups": "counter", "grammar_compile_seconds": "histogram", "grammar_mask_seconds": "histogram",
    "grammar_matchers_live": "gauge",
    # the router's admission queue (issue 17)
    "admission_queue_length": "gauge", "admission_queue_seconds": "histogram", "admission_rejections": "counter",
    # cache-aware routing (issue 15), and the router's reuse of a conversation's tokenization
    "routing_decisions": "counter", "routing_cache_queries": "counter", "tokenizer_reused_tokens": "counter",
    "local_prefills": "counter",
    # choices the router ran again after a worker failed them
    "request_retries": "counter",
    # the Responses API's stored responses
    "responses_stored": "gauge", "responses_stored_bytes": "gauge",
}


def families(body: bytes) -> dict:
    """Parsed exposition, keyed by family name; `_created` companions left out."""
    return {f.name: f for f in text_string_to_metric_families(body.decode())
            if not f.name.endswith("_created")}


def value(fams: dict, family: str, sample: str | None = None, **labels: str) -> float:
    fam = fams[f"pdserve:{family}"]
    name = f"pdserve:{sample or family}"
    hits = [s.value for s in fam.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, fam.samples)
    return hits[0]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_worker_and_router_expose_every_expected_metric() -> None:
    worker = families(WorkerMetrics("decode", "m").render())
    router = families(RouterMetrics("m").render())
    names = {n.removeprefix("pdserve:"): f.type for n, f in {**worker, **router}.items()}
    assert names == EXPECTED
    assert all(n.startswith("pdserve:") for n in [*worker, *router])


def test_worker_counts_match_a_scripted_run() -> None:
    m = WorkerMetrics("decode", "smollm2")
    m.set_load(running=3, waiting=2, used_blocks=30, total_blocks=120)
    for reason, prompt, generated in (("stop", 10, 5), ("stop", 7, 9), ("length", 4, 16), ("abort", 3, 0)):
        m.request_finished(reason, prompt_tokens=prompt, generation_tokens=generated,
                           queue_s=0.01, prefill_s=0.2, decode_s=1.5)
    for state in ("done", "done", "done", "failed", "aborted", "weird"):
        m.room_ended(state)
    m.kv_transferred(0.004, 1 << 20)
    m.kv_transferred(0.006, 3 << 20)
    m.aborted("router")
    m.aborted("peer")
    m.aborted("made-up")
    m.late_messages_dropped.inc(2)
    for _ in range(5):
        m.scheduler_step(0.003, 0.0004)
    for seconds, woken in ((0.006, True), (0.009, True), (0.02, False)):
        m.follow_up_waited(seconds, woken)

    f = families(m.render())
    assert value(f, "num_requests_running") == 3 and value(f, "num_requests_waiting") == 2
    assert value(f, "kv_blocks_used") == 30 and value(f, "kv_blocks_total") == 120
    assert value(f, "kv_cache_usage_perc") == pytest.approx(0.25)
    assert value(f, "prompt_tokens", "prompt_tokens_total") == 24
    assert value(f, "generation_tokens", "generation_tokens_total") == 30
    success = {r: value(f, "request_success", "request_success_total", finished_reason=r) for r in FINISH_REASONS}
    assert success == {"stop": 2, "length": 1, "tool_calls": 0, "abort": 1, "error": 0}
    rooms = {s: value(f, "rooms", "rooms_total", state=s) for s in ("done", "failed", "aborted", "other")}
    assert rooms == {"done": 3, "failed": 1, "aborted": 1, "other": 1}
    assert value(f, "kv_transfer_failures", "kv_transfer_failures_total") == 1
    assert value(f, "kv_transfer_bytes", "kv_transfer_bytes_total") == 4 << 20
    assert value(f, "kv_transfer_seconds", "kv_transfer_seconds_count") == 2
    assert value(f, "kv_transfer_seconds", "kv_transfer_seconds_sum") == pytest.approx(0.01)
    aborts = {o: value(f, "aborts", "aborts_total", origin=o) for o in (*ABORT_ORIGINS, "other")}
    assert aborts == {"client": 0, "router": 1, "peer": 1, "timeout": 0, "drain": 0, "other": 1}
    assert value(f, "late_messages_dropped", "late_messages_dropped_total") == 2
    waits = {o: value(f, "follow_up_waits", "follow_up_waits_total", outcome=o) for o in ("woken", "expired")}
    assert waits == {"woken": 2, "expired": 1}
    assert value(f, "follow_up_wait_seconds", "follow_up_wait_seconds_total") == pytest.approx(0.035)
    assert value(f, "scheduler_step_seconds", "scheduler_step_seconds_count") == 5
    assert value(f, "scheduler_agree_seconds", "scheduler_agree_seconds_bucket", le="0.0005") == 5
    for hist in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert value(f, hist, f"{hist}_count") == 4
        assert value(f, hist, f"{hist}_bucket", le="+Inf") == 4


def test_kv_usage_is_zero_without_a_pool() -> None:
    m = WorkerMetrics("prefill", "m")
    m.set_load(running=0, waiting=0, used_blocks=0, total_blocks=0)
    assert value(families(m.render()), "kv_cache_usage_perc") == 0


def test_router_latencies_from_a_scripted_stream() -> None:
    clock = FakeClock()
    m = RouterMetrics("smollm2", clock=clock)
    timer = m.start_request(prompt_tokens=12)
    clock.now += 0.25
    timer.tokens(1)          # first token: TTFT 0.25 s
    clock.now += 0.04
    timer.tokens(2)          # two tokens after 40 ms: two gaps of 20 ms
    clock.now += 0.01
    timer.tokens(1)
    f = families(m.render())
    assert value(f, "num_requests_running") == 1
    timer.finish("stop")
    timer.finish("abort")    # a late abort after the finish changes nothing
    other = m.start_request(prompt_tokens=3)
    other.finish("abort")
    m.aborted("client")
    m.parser_diagnostic("suppressed")
    m.parser_diagnostic("suppressed")
    m.parser_diagnostic("unknown_tag")

    f = families(m.render())
    assert value(f, "num_requests_running") == 0
    assert value(f, "time_to_first_token_seconds", "time_to_first_token_seconds_count") == 1
    assert value(f, "time_to_first_token_seconds", "time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert value(f, "inter_token_latency_seconds", "inter_token_latency_seconds_count") == 3
    assert value(f, "inter_token_latency_seconds", "inter_token_latency_seconds_sum") == pytest.approx(0.05)
    assert value(f, "e2e_request_latency_seconds", "e2e_request_latency_seconds_count") == 2
    assert value(f, "e2e_request_latency_seconds", "e2e_request_latency_seconds_sum") == pytest.approx(0.30)
    assert value(f, "prompt_tokens", "prompt_tokens_total") == 15
    assert value(f, "generation_tokens", "generation_tokens_total") == 4
    assert value(f, "request_success", "request_success_total", finished_reason="stop") == 1
    assert value(f, "request_success", "request_success_total", finished_reason="abort") == 1
    assert value(f, "aborts", "aborts_total", origin="client") == 1
    assert value(f, "parser_diagnostics", "parser_diagnostics_total", kind="suppressed") == 2
    assert value(f, "parser_diagnostics", "parser_diagnostics_total", kind="unknown_tag") == 1


def test_first_chunk_of_several_tokens_counts_zero_gaps() -> None:
    clock = FakeClock()
    m = RouterMetrics("m", clock=clock)
    timer = m.start_request(prompt_tokens=1)
    clock.now += 0.5
    timer.tokens(3)
    f = families(m.render())
    assert value(f, "inter_token_latency_seconds", "inter_token_latency_seconds_count") == 2
    assert value(f, "inter_token_latency_seconds", "inter_token_latency_seconds_sum") == 0
    assert value(f, "generation_tokens", "generation_tokens_total") == 3


def test_every_series_carries_model_name_and_role() -> None:
    for m, role in ((WorkerMetrics("prefill", "llama"), "prefill"), (RouterMetrics("llama"), "router")):
        for fam in text_string_to_metric_families(m.render().decode()):
            for s in fam.samples:
                assert s.labels.get("model_name") == "llama" and s.labels.get("role") == role, s


def test_instances_have_their_own_registries() -> None:
    """No module-level metrics: two servers in one process (tests, `pdserve serve`) coexist."""
    a, b = WorkerMetrics("decode", "a"), WorkerMetrics("decode", "b")
    a.aborted("client")
    assert value(families(a.render()), "aborts", "aborts_total", origin="client") == 1
    assert value(families(b.render()), "aborts", "aborts_total", origin="client") == 0
    assert a.registry is not b.registry
    default = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "pdserve:" not in default


def test_worker_role_is_checked() -> None:
    with pytest.raises(ValueError):
        WorkerMetrics("router", "m")


# ---------------------------------------------------------------- dashboard and alerts

def referenced(expr: str) -> set[str]:
    """Metric families an expression uses (histogram and counter suffixes stripped)."""
    names = set(re.findall(r"pdserve:(\w+)", expr))
    out = set()
    for n in names:
        for suffix in ("_bucket", "_count", "_sum", "_total"):
            if n.endswith(suffix) and n[: -len(suffix)] in EXPECTED:
                n = n[: -len(suffix)]
                break
        out.add(n)
    return out


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_uses_only_defined_metrics_and_shows_all() -> None:
    used: set[str] = set()
    for expr in dashboard_exprs():
        names = referenced(expr)
        assert names and names <= set(EXPECTED), expr
        assert expr.count("(") == expr.count(")"), expr
        used |= names
    assert used == set(EXPECTED)


def test_dashboard_is_grafana_json_with_a_datasource_variable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "model_name"} <= set(variables)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]


def test_alert_rules_use_only_defined_metrics() -> None:
    rule = yaml.safe_load(RULES.read_text())
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            names = referenced(r["expr"])
            assert names and names <= set(EXPECTED), r["alert"]


def test_the_router_reads_its_response_store_at_each_scrape() -> None:
    from pdserve.frontend.response_store import ResponseStore

    metrics, store = RouterMetrics("m"), ResponseStore(4)
    metrics.watch_responses(store)
    store.put({"id": "resp_a"}, (), [{"type": "message", "role": "user", "content": "hi"}], [])
    fams = families(metrics.render())
    assert value(fams, "responses_stored") == 1 and value(fams, "responses_stored_bytes") == store.bytes > 0
    store.delete("resp_a")
    fams = families(metrics.render())
    assert value(fams, "responses_stored") == value(fams, "responses_stored_bytes") == 0
