"""The router app in-process with every worker down: each bad input gets its status and an OpenAI
error object before a worker is involved; a good one gets 503; the side routes answer."""
from __future__ import annotations

import pytest

from tests.frontend.router_cases import API_KEY, CHAT, bad_input_cases, chat, check_error

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CASES = bad_input_cases(64 << 10)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_its_status_and_an_error_object(no_worker_client, case):
    r = no_worker_client.request(case.method, case.path, **case.request_kwargs())
    check_error(r.status_code, r.json(), case)
    assert r.headers["x-request-id"]


def test_bad_input_matrix_has_at_least_25_cases():
    assert len(CASES) >= 25


@pytest.mark.parametrize("stream", [False, True])
def test_no_worker_available_is_a_503_before_any_stream(no_worker_client, stream):
    r = no_worker_client.post(CHAT, json=chat(stream=stream), headers=AUTH)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "service_unavailable"


def test_health_is_live_and_ready_is_503_without_workers_and_lists_them(no_worker_client):
    assert no_worker_client.get("/health").status_code == 200
    r = no_worker_client.get("/ready")
    assert r.status_code == 503
    assert {w["role"] for w in r.json()["workers"]} == {"prefill", "decode"}


def test_a_prefix_cache_reset_with_no_worker_to_reset_is_a_503(no_worker_client):
    assert no_worker_client.post("/reset_prefix_cache").status_code == 401
    r = no_worker_client.post("/reset_prefix_cache", headers=AUTH)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["message"] == "No worker is in rotation: no prefix cache could be reset."


def test_models_need_the_key_and_a_ready_router(no_worker_client):
    assert no_worker_client.get("/v1/models").status_code == 401
    r = no_worker_client.get("/v1/models", headers=AUTH)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert no_worker_client.get("/v1/models/default", headers=AUTH).status_code == 503
    assert no_worker_client.get("/v1/models/other", headers=AUTH).status_code == 404


def test_request_id_is_echoed(no_worker_client):
    r = no_worker_client.post(CHAT, json=chat(), headers={**AUTH, "X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"


def test_metrics_are_prometheus_text(no_worker_client):
    no_worker_client.post(CHAT, json=chat(n=0), headers=AUTH)
    r = no_worker_client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=")
    assert 'pdserve:num_requests_running{model_name="SmolLM2-135M-Instruct",role="router"} 0.0' in r.text
