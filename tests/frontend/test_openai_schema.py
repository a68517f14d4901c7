"""Schema fuzzing with OpenAI's own API description (``openai_spec/``, pruned to the three
operations pdserve serves) against `pdserve serve --mode pd`: schemathesis generates requests the
schema allows, and every answer is checked.

* no 5xx, ever;
* a 2xx answer conforms to OpenAI's response schema (JSON bodies; streams are checked by the
  SDK conformance test);
* a schema-valid request is refused only for a deliberate reason listed in ``DELIBERATE`` (and
  in the README's "Deliberate refusals"), with an OpenAI error object.

Every body is pointed at the served model with a small output budget (at most 4 tokens, 2
choices): what the schema allows there (any model id, n up to 128, no output limit) would only
measure patience. Examples are derandomized, so a run is reproducible.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.frontend.router_cases import API_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SPEC = Path(__file__).parent / "openai_spec" / "openapi.json"
MODEL = "SmolLM2-135M-Instruct"
MAX_OUTPUT = 4
MAX_N = 2
EXAMPLES = {("POST", "/chat/completions"): 60, ("POST", "/completions"): 50, ("GET", "/models"): 5}

# The refusals pdserve makes on purpose (README, "Deliberate refusals"): the error message matched.
DELIBERATE = {
    "suffix": r"^suffix is not supported",
    "best_of": r"^best_of is not supported",
    "non-text content parts": r"only text content parts are supported",
    "non-function tools": r"only tools of type 'function' are supported",
    "tool names with spaces, quotes or angle brackets": r"function\.name must be 1-128 characters",
    "tool_choice shapes other than none/auto/required/named function": r"tool_choice must be|tool_choice .* needs",
    "response_format other than text": r"response_format",
    "logit_bias keys that are not token ids, biases outside [-100, 100]":
        r"keys must be token ids|outside the vocabulary|biases must be in \[-100, 100\]",
    "token ids outside the vocabulary": r"outside the vocabulary",
    "empty prompts": r"prompt must not be empty|a token-id prompt must not be empty|prompt must not be an empty list",
    "over the context": r"maximum context length is",
    "messages the chat template refuses": r"the chat template rejected the messages",
    "tool call arguments that are not a JSON object": r"tool call arguments must be a JSON object",
    "top_logprobs without logprobs": r"top_logprobs requires logprobs",
    "stream_options without stream": r"stream_options is only allowed when stream is true",
    "more than 16 stop sequences": r"stop sequences are allowed",
    "min_tokens over max_tokens": r"min_tokens",
    "audio output": r"only text output is supported|audio output is not supported",
    "web search": r"web search is not supported",
    "functions and function_call (deprecated)": r"functions and function_call \(deprecated by OpenAI\)",
    "an output budget under one token":
        r"^(max_tokens|max_completion_tokens): Input should be greater than or equal to 1",
}


@pytest.fixture(scope="module")
def schema():
    spec = json.loads(SPEC.read_text(encoding="utf-8"))
    # echo with logprobs: the first prompt token has no logprob (nothing precedes it), and
    # OpenAI's API (as vLLM) answers null there, which the published types leave out
    logprobs = spec["components"]["schemas"]["CreateCompletionResponse"]["properties"]["choices"]["items"][
        "properties"]["logprobs"]["anyOf"][0]["properties"]
    logprobs["token_logprobs"]["items"]["type"] = ["number", "null"]
    logprobs["top_logprobs"]["items"]["type"] = ["object", "null"]
    return schemathesis.openapi.from_dict(spec)


def pointed_at_us(body: Any, path: str) -> Any:
    """The served model, and a small output budget (see the module's docstring)."""
    if not isinstance(body, dict):
        return body
    body = {**body, "model": MODEL}
    n = body.get("n")
    if _number(n) and n > MAX_N:  # JSON Schema integers include 70.0
        if body.get("best_of") == n:
            body["best_of"] = MAX_N
        body["n"] = MAX_N
    limits = ("max_tokens", "max_completion_tokens") if path == "/chat/completions" else ("max_tokens",)
    for key in limits:
        if _number(body.get(key)) and body[key] > MAX_OUTPUT:
            body[key] = MAX_OUTPUT
    if not any(_number(body.get(k)) for k in limits):
        body[limits[0]] = MAX_OUTPUT
    return body


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def deliberate(message: str) -> str | None:
    return next((why for why, pattern in DELIBERATE.items() if re.search(pattern, message)), None)


@pytest.mark.parametrize("method,path", list(EXAMPLES), ids=lambda v: v.strip("/").replace("/", "_"))
def test_schema_valid_requests_get_schema_valid_answers(pd_server, schema, method, path):
    operation = schema[path][method]
    seen: dict[str, int] = {}

    @settings(max_examples=EXAMPLES[(method, path)], deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy())
    def check(case) -> None:
        case.body = pointed_at_us(case.body, path)
        response = case.call(base_url=pd_server.v1, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
        status = response.status_code
        assert status < 500, (status, response.text[:2000], case.body)
        if status < 300:
            seen["ok"] = seen.get("ok", 0) + 1
            if not "".join(response.headers.get("content-type", [])).startswith("text/event-stream"):
                operation.validate_response(response, case=case)
            return
        error = response.json().get("error")
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, response.text
        why = deliberate(error["message"])
        assert why is not None, (status, error, case.body)
        seen[why] = seen.get(why, 0) + 1

    check()
    assert seen.get("ok", 0) > 0, seen  # most of what the schema allows is answered
