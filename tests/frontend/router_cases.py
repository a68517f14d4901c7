"""The bad-input matrix: requests the router must refuse, with the status and error they get.

Used twice: in-process against a router with no workers (every refusal happens before a worker
is involved), and end to end against `pdserve serve`, followed there by a request that succeeds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

API_KEY = "test-key"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
OVER_CONTEXT_WORDS = 9000  # one token per " hello": over SmolLM2's 8192-token context


@dataclass
class Case:
    name: str
    path: str
    body: Any = None                     # JSON-encoded unless `raw` is given
    status: int = 400
    code: str | None = None              # expected error.code, when it matters
    param: str | None = None             # expected error.param, when it matters
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"

    def request_kwargs(self) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **self.headers}
        content = self.raw if self.raw is not None else (
            json.dumps(self.body).encode() if self.body is not None else None)
        return {"headers": headers, "content": content}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hello", "max_tokens": 4, **fields}


def response(**fields: Any) -> dict[str, Any]:
    return {"input": "Hi", "max_output_tokens": 4, **fields}


WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def bad_input_cases(max_body: int) -> list[Case]:
    long_text = " hello" * OVER_CONTEXT_WORDS
    return [
        Case("invalid_json", CHAT, raw=b'{"messages": [', code="invalid_json"),
        Case("body_not_object", CHAT, body=[1, 2, 3]),
        Case("wrong_content_type", CHAT, raw=b"messages=hi", headers={"Content-Type": "text/plain"},
             code="invalid_content_type"),
        Case("messages_not_list", CHAT, body={"messages": "hello"}, param="messages"),
        Case("messages_missing", CHAT, body={"max_tokens": 4}, param="messages"),
        Case("empty_messages", CHAT, body=chat(messages=[]), param="messages"),
        Case("unknown_role", CHAT, body=chat(messages=[{"role": "wizard", "content": "hi"}]),
             param="messages.0.role"),
        Case("image_content_part", CHAT, body=chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])),
        Case("negative_max_tokens", CHAT, body=chat(max_tokens=-5), param="max_tokens"),
        Case("zero_max_tokens", CHAT, body=chat(max_tokens=0), param="max_tokens"),
        Case("huge_max_tokens", CHAT, body=chat(max_tokens=10**9), code="context_length_exceeded"),
        Case("max_tokens_wrong_type", CHAT, body=chat(max_tokens="ten"), param="max_tokens"),
        Case("temperature_too_high", CHAT, body=chat(temperature=3.5), param="temperature"),
        Case("temperature_negative", CHAT, body=chat(temperature=-0.1), param="temperature"),
        Case("temperature_wrong_type", CHAT, body=chat(temperature="hot"), param="temperature"),
        Case("top_p_over_one", CHAT, body=chat(top_p=1.5), param="top_p"),
        Case("n_zero", CHAT, body=chat(n=0), param="n"),
        Case("n_too_large", CHAT, body=chat(n=1000), param="n"),
        Case("too_many_stop_strings", CHAT, body=chat(stop=[f"s{i}" for i in range(17)]), param="stop"),
        Case("stop_wrong_type", CHAT, body=chat(stop=5), param="stop"),
        Case("unknown_model", CHAT, body=chat(model="gpt-17"), status=404, code="model_not_found"),
        Case("chat_over_context", CHAT, body=chat(messages=[{"role": "user", "content": long_text}]),
             code="context_length_exceeded", param="messages"),
        Case("presence_penalty_out_of_range", CHAT, body=chat(presence_penalty=5), param="presence_penalty"),
        Case("logit_bias_bad_key", CHAT, body=chat(logit_bias={"abc": 1}), param="logit_bias"),
        Case("logit_bias_unknown_token", CHAT, body=chat(logit_bias={"999999": 1}), param="logit_bias"),
        Case("allowed_token_ids_empty", CHAT, body=chat(allowed_token_ids=[]), param="allowed_token_ids"),
        Case("bad_words_blank", CHAT, body=chat(bad_words=["ok", " "]), param="bad_words"),
        Case("cache_salt_empty", CHAT, body=chat(cache_salt=""), param="cache_salt"),
        Case("audio_modality", CHAT, body=chat(modalities=["text", "audio"]), param="modalities"),
        Case("audio_output", CHAT, body=chat(audio={"voice": "alloy", "format": "wav"}), param="audio"),
        Case("web_search", CHAT, body=chat(web_search_options={}), param="web_search_options"),
        Case("legacy_functions", CHAT, body=chat(functions=[{"name": "f", "parameters": {}}]), param="functions"),
        Case("legacy_function_call", CHAT, body=chat(function_call={"name": "f"}), param="function_call"),
        Case("priority_without_the_priority_policy", CHAT, body=chat(priority=1), param="priority"),
        Case("responses_cache_salt_empty", RESPONSES, body=response(cache_salt=""), param="cache_salt"),
        Case("bad_words_too_many", COMPLETIONS, body=completion(bad_words=[f"w{i}" for i in range(129)]),
             param="bad_words"),
        Case("allowed_token_ids_unknown_token", COMPLETIONS, body=completion(allowed_token_ids=[5, 999999]),
             param="allowed_token_ids"),
        Case("allowed_token_ids_with_a_schema", CHAT, body=chat(allowed_token_ids=[5], response_format={
            "type": "json_object"}), param="allowed_token_ids"),
        Case("top_logprobs_without_logprobs", CHAT, body=chat(top_logprobs=3)),
        Case("top_logprobs_too_many", CHAT, body=chat(logprobs=True, top_logprobs=50), param="top_logprobs"),
        Case("stream_options_without_stream", CHAT, body=chat(stream_options={"include_usage": True})),
        Case("seed_wrong_type", CHAT, body=chat(seed="abc"), param="seed"),
        Case("min_tokens_over_max_tokens", CHAT, body=chat(min_tokens=10, max_tokens=4), param="min_tokens"),
        Case("completion_prompt_missing", COMPLETIONS, body={"max_tokens": 4}, param="prompt"),
        Case("completion_empty_prompt_list", COMPLETIONS, body=completion(prompt=[]), param="prompt"),
        Case("completion_token_out_of_vocab", COMPLETIONS, body=completion(prompt=[1, 2, 10**7]),
             param="prompt"),
        Case("completion_over_context", COMPLETIONS, body=completion(prompt=[28] * 9000),
             code="context_length_exceeded", param="prompt"),
        Case("completion_logprobs_too_many", COMPLETIONS, body=completion(logprobs=50), param="logprobs"),
        Case("responses_input_missing", RESPONSES, body={"max_output_tokens": 4}, param="input"),
        Case("responses_empty_input", RESPONSES, body=response(input="")),
        Case("responses_previous_response_unknown", RESPONSES, body=response(previous_response_id="resp_123"),
             code="previous_response_not_found", param="previous_response_id"),
        Case("responses_conversation", RESPONSES, body=response(conversation="conv_123")),
        Case("responses_get_unknown", RESPONSES + "/resp_123", method="GET", status=404, param="response_id"),
        Case("responses_delete_unknown", RESPONSES + "/resp_123", method="DELETE", status=404,
             param="response_id"),
        Case("responses_input_items_unknown", RESPONSES + "/resp_123/input_items", method="GET", status=404,
             param="response_id"),
        Case("responses_input_items_limit", RESPONSES + "/resp_123/input_items?limit=0", method="GET",
             param="limit"),
        Case("responses_background", RESPONSES, body=response(background=True)),
        Case("responses_prompt_template", RESPONSES, body=response(prompt={"id": "pmpt_123"})),
        Case("responses_top_logprobs_over_20", RESPONSES, body=response(include=["message.output_text.logprobs"],
                                                                          top_logprobs=21), param="top_logprobs"),
        Case("responses_include_unknown", RESPONSES, body=response(include=["reasoning.summary_text"])),
        Case("responses_zero_max_output_tokens", RESPONSES, body=response(max_output_tokens=0),
             param="max_output_tokens"),
        Case("responses_image_part", RESPONSES, body=response(input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}]), param="input[0].content[0]"),
        Case("responses_unknown_item_type", RESPONSES, body=response(input=[{"type": "computer_call", "id": "cu_1"}]),
             param="input[0].type"),
        Case("responses_unknown_item_reference", RESPONSES,
             body=response(input=[{"type": "item_reference", "id": "msg_1"}]), param="input[0].id"),
        Case("responses_call_without_call_id", RESPONSES, body=response(input=[
            {"type": "function_call", "name": "get_weather", "arguments": "{}"}]), param="input[0].call_id"),
        Case("responses_web_search_tool", RESPONSES, body=response(tools=[{"type": "web_search"}]),
             param="tools[0]"),
        Case("responses_tool_choice_unknown_function", RESPONSES,
             body=response(tools=[WEATHER], tool_choice={"type": "function", "name": "get_time"})),
        Case("responses_allowed_tools_unknown_function", RESPONSES, body=response(tools=[WEATHER], tool_choice={
            "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]})),
        Case("responses_allowed_tools_malformed", RESPONSES, body=response(tools=[WEATHER], tool_choice={
            "type": "allowed_tools", "mode": "auto", "tools": [{"name": "get_weather"}]}), param="tool_choice"),
        Case("responses_over_context", RESPONSES, body=response(input=long_text), code="context_length_exceeded",
             param="input"),
        Case("oversize_body", CHAT, body=chat(padding="x" * (max_body + 1)), status=413,
             code="request_too_large"),
        Case("bad_api_key", CHAT, body=chat(), status=401, code="invalid_api_key",
             headers={"Authorization": "Bearer wrong"}),
        Case("missing_api_key", CHAT, body=chat(), status=401, code="invalid_api_key",
             headers={"Authorization": ""}),
        Case("bad_request_id", CHAT, body=chat(), headers={"X-Request-Id": "has spaces in it"},
             param="X-Request-Id"),
        Case("get_on_post_route", CHAT, method="GET", status=405),
        Case("unknown_path", "/v1/nothing", body={}, status=404),
    ]


def check_error(status: int, body: Any, case: Case) -> None:
    assert status == case.status, (case.name, status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, (case.name, body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, (case.name, err)
    assert isinstance(err["message"], str) and err["message"], (case.name, err)
    if case.code is not None:
        assert err["code"] == case.code, (case.name, err)
    if case.param is not None:
        assert err["param"] == case.param, (case.name, err)
