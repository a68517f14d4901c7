"""Quantized CPU weights on the default model: decode step time and perplexity per format.

    python bench/quantization.py [--threads 1 2] [--quant none gguf int8] [--batches 1 32] [--ppl]

Decode step: an engine generates 8 and then 40 tokens for `batch` prompts (ignore_eos); the
difference over 32 steps is one decode step (prefill and start-up cancel out); best of two.
Perplexity: tests/models/data/public_domain_en.txt (2,024 tokens) in windows of 512, the text
the tests use. Run it on a quiet machine: other jobs on the same cores move these numbers 2-4x.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent.parent / "tests" / "models" / "data" / "public_domain_en.txt"
QUANT_NAMES = {"none": "fp32", "gguf": "Q4_1 (GGUF blocks)", "int8": "Q8_0 (int8 on load)",
               "int4": "Q4_1 (int4 on load)"}


def decode_step_ms(quant: str, threads: int, batch: int) -> float:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM(EngineConfig(quantization=quant, threads=threads))
    prompts = [f"Write a story about the number {i}." for i in range(batch)]

    def run(tokens: int) -> float:
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - t

    run(2)
    return min((run(40) - run(8)) / 32 for _ in range(2)) * 1e3


def perplexity(quant: str, window: int = 512) -> float:
    from pdserve.models import load_model
    from pdserve.quantize import forward_tokens
    from pdserve.tokenizer import Tokenizer
    from pdserve.weights import resolve_model_path

    model_dir = resolve_model_path(None)
    ids = Tokenizer(model_dir).encode(TEXT.read_text(encoding="utf-8"))
    model = load_model(model_dir, quantization=quant)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        seg = ids[start:start + window + 1]
        with torch.inference_mode():
            logp = torch.log_softmax(model.compute_logits(forward_tokens(model, seg[:-1])), dim=-1)
        nll -= float(logp.gather(1, torch.tensor(seg[1:])[:, None]).sum())
        count += len(seg) - 1
    return math.exp(nll / count)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--quant", nargs="+", default=["none", "gguf", "int8"], choices=sorted(QUANT_NAMES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--ppl", action="store_true", help="also the perplexity of each format")
    args = p.parse_args()
    import pdserve_kernels as ops

    ops.configure("cpu", torch.float32, "auto")  # the choice is logged
    for quant in args.quant:
        for threads in args.threads:
            for batch in args.batches:
                ms = decode_step_ms(quant, threads, batch)
                print(f"{QUANT_NAMES[quant]:22s} threads {threads} batch {batch:3d}: {ms:7.1f} ms/step "
                      f"({batch * 1e3 / ms:6.1f} tok/s)", flush=True)
        if args.ppl:
            print(f"{QUANT_NAMES[quant]:22s} perplexity {perplexity(quant):.3f}", flush=True)


if __name__ == "__main__":
    main()
