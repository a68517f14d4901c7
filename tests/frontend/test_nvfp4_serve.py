"""`pdserve serve --model <nvfp4 dir>` on the CPU (torch reference path), through PD: a prefill
and a decode worker load the NVFP4 checkpoint, and the OpenAI API answers like the engine alone."""
from __future__ import annotations

import openai
import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from tests.frontend.conftest import start_server, stop_server

QUESTION = "What is the capital of France?"


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_serve_pd_answers_from_an_nvfp4_checkpoint(nvfp4_default_dir):
    ref = LLM(EngineConfig(model=nvfp4_default_dir)).generate(
        [QUESTION], SamplingParams(temperature=0, max_tokens=12), chat=True)[0].text
    server = start_server("--mode", "pd", "--model", nvfp4_default_dir, "--served-model-name", "nvfp4")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="nvfp4", messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=12, temperature=0)
    finally:
        stop_server(server.proc)
    answer = r.choices[0].message.content
    assert answer == ref and "Paris" in answer, (answer, ref)
