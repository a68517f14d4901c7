"""`LLM`: text in, text out, on top of the engine (what `pdserve generate` and the tests use)."""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from pdserve.textstream import TextStream
from pdserve.tokenizer import Tokenizer

from .config import EngineConfig
from .llm_engine import LLMEngine
from .sampling_params import SamplingParams
from .sequence import TokenLogprobs


@dataclass
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class LLM:
    """Offline generation with stop strings handled on detokenized text."""

    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.engine = LLMEngine(config or EngineConfig(**kwargs))
        self.tokenizer = Tokenizer(self.engine.model_dir)
        self._ids = itertools.count()

    def prompt_ids(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if chat:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def stream(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
               chat: bool = False) -> Iterator[tuple[int, str, Completion]]:
        """Yield (prompt index, text delta, completion so far) as tokens come out."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        done: dict[str, Completion] = {}
        index, streams = {}, {}
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            rid = f"gen-{next(self._ids)}"
            self.engine.add_request(rid, self.prompt_ids(prompt, chat), p)
            done[rid], index[rid], streams[rid] = Completion(rid), i, TextStream(self.tokenizer, p.stop)
        while self.engine.has_work():
            for out in self.engine.step()[1]:
                c, ts = done[out.request_id], streams[out.request_id]
                delta = ""
                if out.token_id is not None and not ts.stopped:
                    c.token_ids.append(out.token_id)
                    if out.logprobs is not None:
                        c.logprobs.append(out.logprobs)
                    delta = ts.push([out.token_id])
                    if ts.stopped:
                        self.engine.abort(out.request_id, "stop")
                        c.finish_reason = "stop"
                if out.finish_reason and c.finish_reason is None:
                    c.finish_reason, c.error = out.finish_reason, out.error
                    delta += ts.flush()
                c.text += delta
                if delta or out.finish_reason:
                    yield index[out.request_id], delta, c

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
                 chat: bool = False) -> list[Completion]:
        results: dict[int, Completion] = {}
        for i, _, c in self.stream(prompts, params, chat):
            results[i] = c
        return [results[i] for i in range(len(prompts))]
