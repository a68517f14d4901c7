"""A tiny random GLM-5 (MLA + MoE + DSA) with the real GLM-5 tokenizer through `pdserve serve`:
PD mode — the MLA latents and the bf16 index keys travel over NIXL — gives the tokens of
colocated mode."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.frontend.conftest import Server, start_server, stop_server
from tests.frontend.scripted import FAMILIES, write_tokenizer
from tests.tiny_models import make_deepseek

PROMPTS = ["Write a haiku about the sea.", "List three prime numbers and explain why each is prime.",
           "Say hello to everyone in the room, politely.", "What is the capital of France? Answer in one word, then explain the history of the city."]


def completions(server: Server) -> list[list[str]]:
    """Greedy continuations (token strings, from logprobs) of every prompt, one after another."""
    with httpx.Client(timeout=120) as client:
        outs = []
        for prompt in PROMPTS:
            r = client.post(f"{server.url}/v1/chat/completions", json={
                "model": "tiny-glm5", "messages": [{"role": "user", "content": prompt}],
                "temperature": 0, "max_tokens": 20, "ignore_eos": True, "logprobs": True})
            assert r.status_code == 200, r.text + "\nthe server's last lines:\n" + "\n".join(list(server.log)[-60:])
            body = r.json()
            assert body["usage"]["prompt_tokens"] > 8  # past index_topk: sparsity applies
            outs.append([t["token"] for t in body["choices"][0]["logprobs"]["content"]])
    return outs


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_pd_equals_colocated(tmp_path):
    family = FAMILIES["glm"]
    tok = write_tokenizer(family.key, tmp_path)
    make_deepseek(tmp_path, "glm-5", vocab_size=tok.get_vocab_size(with_added_tokens=True),
                  eos_token_id=tok.token_to_id(family.eos), index_topk=8)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa"
    modes = ("pd", "colocated")
    with ThreadPoolExecutor(len(modes)) as pool:  # the two start-ups overlap
        starts = [pool.submit(start_server, "--model", str(tmp_path), "--served-model-name", "tiny-glm5",
                              "--mode", mode) for mode in modes]
    try:
        servers = {mode: start.result() for mode, start in zip(modes, starts)}
        results = {mode: completions(server) for mode, server in servers.items()}
    finally:
        codes = [stop_server(start.result().proc) for start in starts if start.exception() is None]
    assert codes == [0, 0]
    assert all(len(r) == 20 for r in results["pd"])
    assert results["pd"] == results["colocated"]
