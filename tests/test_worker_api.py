"""The worker contract (pdserve/worker_api.py) and its description (pdserve/worker/API.md) agree,
and its messages survive the wire as both sides read them."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from pdserve import worker_api as api

API_MD = (Path(__file__).resolve().parent.parent / "pdserve" / "worker" / "API.md").read_text(encoding="utf-8")
NODE0 = API_MD.split("Multi-node TP")[0]  # the API the router calls (follower nodes serve their own probes)


def _row(method: str, path: str) -> str:
    rows = [line for line in NODE0.splitlines() if re.match(rf"\|\s*{method}\s*\|\s*{re.escape(path)}\s*\|", line)]
    assert len(rows) == 1, f"API.md has {len(rows)} rows for {method} {path}"
    return rows[0]


@pytest.mark.parametrize("endpoint", api.ENDPOINTS, ids=lambda e: f"{e.method} {e.path}")
def test_api_md_names_every_message_and_field_of_each_endpoint(endpoint: api.Endpoint) -> None:
    row = _row(endpoint.method, endpoint.path)
    models = [m for m in (endpoint.request, *endpoint.answers) if m is not None]
    for model in models:
        missing = [f for f in model.model_fields if f'"{f}"' not in row]
        assert not missing, f"{endpoint.method} {endpoint.path}: API.md does not name {model.__name__}.{missing}"
    named = {m.__name__ for m in models if m.__name__ not in ("Room", "TokenLogprob", "DecodeTarget")}
    assert all(f"`{n}`" in row for n in named), f"API.md's {endpoint.path} row should name {sorted(named)}"


def test_api_md_names_every_sampling_field_and_error_code() -> None:
    fields = [f.name for f in dataclasses.fields(api.SamplingParams) if f.name != "stop"]
    assert not [f for f in fields if f not in API_MD]
    for code in api.ErrorCode:
        assert f"{code.status} `{code.value}`" in API_MD, code


def test_wire_params_leave_the_stop_strings_with_the_router() -> None:
    params = api.SamplingParams(temperature=0, stop=["\n"], logit_bias={5: -1.0}, max_tokens=3)
    wire = api.GenerateRequest(request_id="r", prompt_ids=[1, 2], params=params).wire()
    assert "stop" not in wire["params"] and wire["params"]["logit_bias"] == {"5": -1.0}
    back = api.GenerateRequest.model_validate(wire)
    assert back.params == dataclasses.replace(params, stop=[])


def test_a_request_serialized_by_pydantic_is_the_same_body() -> None:
    """`wire_json` (what the router posts for /generate and /prefill) carries what `wire` does."""
    params = api.SamplingParams(temperature=0.7, top_p=0.9, seed=2**40, stop=["x"], logit_bias={5: -1.5},
                                max_tokens=3, cache_salt="s", priority=-2)
    for body in (api.GenerateRequest(request_id="r", prompt_ids=list(range(3000)), params=params,
                                     prefill_url="http://p", prefill_worker_id="p1"),
                 api.PrefillRequest(request_id="r", prompt_ids=[1, 2, 3], params=params,
                                    decode=api.DecodeTarget(worker_id="d", decode_url="http://d", blocks=[4],
                                                            cached_blocks=1))):
        assert json.loads(body.wire_json()) == body.wire()
        assert type(body).model_validate_json(body.wire_json()) == type(body).model_validate(body.wire())


def test_stream_lines_parse_into_their_types() -> None:
    room = api.parse_line('{"room": {"request_id": "r", "blocks": [3, 4], "worker_id": "d"}}')
    assert isinstance(room, api.RoomLine) and room.room.blocks == [3, 4] and room.room.decode_url is None
    line = api.line(api.TokenLine(token_ids=[7], finish_reason=api.FinishReason.LENGTH))
    tokens = api.parse_line(line.decode())
    assert isinstance(tokens, api.TokenLine) and tokens.finish_reason is api.FinishReason.LENGTH
    with pytest.raises(ValueError):
        api.parse_line('{"token_ids": "seven"}')
    with pytest.raises(ValueError):
        api.parse_line("[1, 2]")


def test_a_failed_prefill_is_a_typed_error_status() -> None:
    body = api.ErrorBody.of(api.ErrorCode.PREFILL_FAILED, "transfer failed").wire()
    assert body == {"error": {"message": "transfer failed", "type": "server_error", "code": "prefill_failed"}}
    assert api.ErrorCode.PREFILL_FAILED.status == 500 and api.ErrorCode.DRAINING.status == 503
    assert {c for c in api.ErrorCode if c.prefill_failure} == {
        api.ErrorCode.PREFILL_FAILED, api.ErrorCode.DECODE_UNREACHABLE, api.ErrorCode.ABORTED}
