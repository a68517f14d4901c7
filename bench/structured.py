"""Structured outputs: the throughput cost of grammar-constrained decoding, and compile time.

    python bench/structured.py [--model PATH] [--streams 32] [--output-len 96] [--fractions 0,50,100]
                               [--threads 2] [--repeats 1] [--backends] [--out PATH]

Throughput: --streams requests at once through the engine (greedy, every request emits exactly
--output-len tokens: the schema's documents are longer than that), with 0 %, 50 % and 100 % of
them constrained by a realistic schema (an order with customer, address and line items). The
numbers to compare are output tokens per CPU-second of this process (the grammar thread's
work included; a busy machine disturbs it far less than wall time) and output tok/s, against
the unconstrained runs; the fractions run interleaved, --repeats rounds. The per-step mask CPU
time comes from the engine's grammar observer.

Compile: the same schema compiled cold (a fresh cache; the backend's tokenizer table built
beforehand and timed apart) and cached. --backends also measures xgrammar (when installed)
against llguidance on the same tokenizer: compile cold and cached, and the mask time per token
while following one valid document (docs/structured-outputs.md has the choice).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from common import RESULTS, environment, int_list, load_average, table, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.structured import GrammarKind, GrammarSpec  # noqa: E402
from pdserve.structured.factory import grammars_for_tokenizer  # noqa: E402
from pdserve.tokenizer import Tokenizer  # noqa: E402
from pdserve.weights import resolve_model_path  # noqa: E402

ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30},
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": {"enum": ["US", "FR", "DE", "JP", "BR"]}},
    "required": ["street", "city", "zip", "country"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
    "customer": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "email": {"type": "string", "format": "email"},
        "vip": {"type": "boolean"}, "address": ADDRESS}, "required": ["name", "email", "vip", "address"],
        "additionalProperties": False},
    "items": {"type": "array", "minItems": 8, "maxItems": 20, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "description": {"type": "string", "maxLength": 60},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
        "unit_price": {"type": "number", "minimum": 0}}, "required": ["sku", "description", "quantity", "unit_price"],
        "additionalProperties": False}},
    "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
    "notes": {"type": ["string", "null"], "maxLength": 200}},
    "required": ["order_id", "customer", "items", "status", "notes"], "additionalProperties": False}
DOCUMENT = {"order_id": "ORD-123456", "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "vip": True,
            "address": {"street": "12 St James Square", "city": "London", "zip": "12345", "country": "FR"}},
            "items": [{"sku": "ABC-0001", "description": "Analytical engine gear", "quantity": 3,
                       "unit_price": 19.5}] * 8, "status": "paid", "notes": None}
PROMPT = "<|im_start|>user\nWrite a realistic customer order as JSON.<|im_end|>\n<|im_start|>assistant\n"


class MaskTimes:
    def __init__(self) -> None:
        self.steps: list[float] = []

    def grammar_compiled(self, seconds: float, cached: bool) -> None:
        pass

    def grammar_masked(self, seconds: float, rows: int) -> None:
        self.steps.append(seconds)

    def grammar_matchers(self, live: int) -> None:
        pass


def throughput(engine: LLMEngine, prompt: list[int], streams: int, constrained: int, output_len: int) -> dict:
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(ORDER))
    engine.grammars.compile(spec)  # as a worker's HTTP layer does before the request reaches the loop
    times = engine.grammars.observer = MaskTimes()
    for i in range(streams):
        structured = spec if i < constrained else None
        engine.add_request(f"b{constrained}-{i}", prompt, SamplingParams(
            temperature=0, max_tokens=output_len, ignore_eos=structured is None, structured=structured))
    cpu0, t0 = time.process_time(), time.perf_counter()
    tokens, reasons = 0, {}
    for o in engine.run_until_done():
        tokens += o.token_id is not None
        if o.finish_reason is not None:
            reasons[str(o.finish_reason)] = reasons.get(str(o.finish_reason), 0) + 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"constrained": constrained, "streams": streams, "output_tokens": tokens, "wall_s": wall, "cpu_s": cpu,
            "tok_s": tokens / wall, "tok_per_cpu_s": tokens / cpu, "finish_reasons": reasons,
            "mask_cpu_ms_per_step_mean": 1e3 * statistics.fmean(times.steps) if times.steps else 0.0,
            "mask_steps": len(times.steps)}


def compile_times(tokenizer: Tokenizer, repeats: int = 5) -> dict:
    t0 = time.perf_counter()
    grammars = grammars_for_tokenizer(tokenizer)
    grammars.backend  # the tokenizer table: once per process and tokenizer
    backend_s = time.perf_counter() - t0
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(ORDER))
    cold, cached = [], []
    for k in range(repeats):
        fresh = GrammarSpec(spec.kind, json.dumps({**ORDER, "title": f"run {k}"}))  # a new cache key
        t0 = time.perf_counter()
        grammars.compile(fresh)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        grammars.compile(fresh)
        cached.append(time.perf_counter() - t0)
    return {"backend": grammars.backend.name, "tokenizer_table_s": backend_s,
            "compile_cold_ms": 1e3 * statistics.median(cold), "compile_cached_ms": 1e3 * statistics.median(cached)}


def compare_backends(tokenizer: Tokenizer) -> list[dict]:
    """llguidance (through pdserve's backend) and xgrammar, on the same tokenizer and schema."""
    doc = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")))
    out = []
    grammars = grammars_for_tokenizer(tokenizer)
    grammars.backend
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(ORDER))
    t0 = time.perf_counter()
    grammars.compile(spec)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = grammars.start(spec)
    cached = time.perf_counter() - t0
    mask = torch.full((1, (tokenizer.vocab_size + 31) // 32), -1, dtype=torch.int32)
    per = []
    for i, token in enumerate(doc):
        t0 = time.perf_counter()
        state.matcher.fill_bitmask(mask, 0)
        per.append(time.perf_counter() - t0)
        state.sync(doc[:i + 1])
    out.append({"backend": "llguidance", "compile_cold_ms": 1e3 * cold, "compile_cached_ms": 1e3 * cached,
                "mask_us_per_token_mean": 1e6 * statistics.fmean(per), "mask_us_per_token_max": 1e6 * max(per),
                "accepting": state.matcher.accepting, "extra_dependencies": "none"})
    try:
        import xgrammar as xgr
    except ImportError as e:
        out.append({"backend": "xgrammar", "error": str(e)})
        return out
    info = xgr.TokenizerInfo(encoded_vocab=[tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)],
                             vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=tokenizer.vocab_size,
                             stop_token_ids=sorted(tokenizer.stop_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    schema = json.dumps(ORDER)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
    cached = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, tokenizer.vocab_size)
    per = []
    for token in doc:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        per.append(time.perf_counter() - t0)
        matcher.accept_token(token)
    out.append({"backend": "xgrammar", "compile_cold_ms": 1e3 * cold, "compile_cached_ms": 1e3 * cached,
                "mask_us_per_token_mean": 1e6 * statistics.fmean(per), "mask_us_per_token_max": 1e6 * max(per),
                "accepting": matcher.is_terminated() or matcher.accept_token(sorted(tokenizer.stop_token_ids)[0]),
                "extra_dependencies": "torch, transformers, triton, apache-tvm-ffi"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--fractions", type=int_list, default=[0, 50, 100], help="percent of streams constrained")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: no OpenMP spinning on a shared box)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of all fractions, interleaved")
    ap.add_argument("--backends", action="store_true", help="also compare llguidance with xgrammar")
    ap.add_argument("--out", type=Path, default=RESULTS / "structured.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(args.model)
    tokenizer = Tokenizer(model_dir)
    print(load_average())
    compile_ = compile_times(tokenizer)
    print(table(["backend", "tokenizer table s", "compile cold ms", "compile cached ms"],
                [[compile_["backend"], compile_["tokenizer_table_s"], compile_["compile_cold_ms"],
                  compile_["compile_cached_ms"]]]))
    backends = compare_backends(tokenizer) if args.backends else []
    if backends:
        print(table(["backend", "compile cold ms", "cached ms", "mask us/token", "max us", "extra deps"],
                    [[b["backend"], b.get("compile_cold_ms"), b.get("compile_cached_ms"),
                      b.get("mask_us_per_token_mean"), b.get("mask_us_per_token_max"),
                      b.get("extra_dependencies", b.get("error"))] for b in backends]))
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_num_seqs=max(args.streams, 1)))
    prompt = tokenizer.encode(PROMPT)
    throughput(engine, prompt, min(4, args.streams), 0, 4)  # warm-up
    runs = []
    for _ in range(args.repeats):
        for pct in args.fractions:
            runs.append({"percent": pct, **throughput(engine, prompt, args.streams, args.streams * pct // 100,
                                                      args.output_len)})
    # the unconstrained runs' mean: the baseline (CPU-time based: the machine is shared)
    zero = [r["tok_per_cpu_s"] for r in runs if r["percent"] == 0]
    base = {0: statistics.fmean(zero)} if zero else {}
    rows = [[r["percent"], r["constrained"], r["output_tokens"], r["tok_s"], r["tok_per_cpu_s"],
             (r["tok_per_cpu_s"] / base[0] - 1) * 100 if 0 in base else None, r["mask_cpu_ms_per_step_mean"],
             r["finish_reasons"]] for r in runs]
    print(table(["% constrained", "streams", "tokens", "tok/s", "tok/cpu-s", "tok/cpu-s vs 0% (%)",
                 "mask cpu ms/step",
                 "finish"], rows))
    write_json(args.out, {"environment": environment(), "model": str(model_dir), "streams": args.streams,
                          "output_len": args.output_len, "schema": ORDER, "compile": compile_,
                          "backends": backends, "runs": runs})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
