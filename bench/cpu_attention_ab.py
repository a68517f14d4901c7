"""The CPU attention (decode and extend) of two builds of libpdserve_cpu.so, alternating: a
kernel change against its base on the same machine, in one script.

    git worktree add /tmp/base <base-rev>
    (cd /tmp/base && $PWD/.venv/bin/python -c 'import pdserve_kernels.cpu_lib as c; print(c.build())')
    .venv/bin/python -c 'import pdserve_kernels.cpu_lib as c; print(c.build())'
    python bench/cpu_attention_ab.py BASE.so NEW.so [--rounds 2]

(the first build prints the base's library: run from the worktree, Python imports its package;
the second, this checkout's). When the two builds differ in their C ABI (`cpu_lib.ABI_VERSION`),
add `--base-checkout /tmp/base`: the base's runs then import that checkout's `pdserve_kernels`.

Each measurement is its own process (a process loads one library): 30 layers' calls of the
default model's shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16), a context of
1,350 keys, for 1 row, 4 rows with their own blocks, 4 rows sharing every block, 4 and 16 rows
sharing their first 1,200 keys (agent sessions over one system prompt: the prefix cache gives
them the same blocks), an agent's later turn (the extend kernel: 52 new tokens over 1,280
cached), and that turn beside 3 decode rows sharing its first 1,200 keys (a mixed step), the
median of 25 passes; with a pool of 2,000 blocks a layer (its K/V far
beyond the last-level cache of most machines: streamed from memory) and of 400. Both instruction
sets that this CPU has.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import RESULTS, environment, table, write_json

# (name, decode rows, keys every sequence shares (its first blocks), new tokens of an extend or 0)
CASES = (("1 row", 1, 0, 0), ("4 rows", 4, 0, 0), ("4 rows, shared blocks", 4, 1350, 0),
         ("4 rows sharing 1,200", 4, 1200, 0), ("16 rows sharing 1,200", 16, 1200, 0),
         ("turn: 52 new over 1,280", 0, 0, 52), ("turn + 3 rows sharing 1,200", 3, 1200, 52))

_ONE = r'''
import json, statistics, sys, time
from pathlib import Path
import torch
from pdserve_kernels import cpu_lib
cpu_lib.build = lambda force=False: Path(sys.argv[1])  # load this build, never rebuild
isa, blocks, threads = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cases = json.loads(sys.argv[5])
torch.manual_seed(0)
layers, bs, kv_heads, d, heads, ctx = 30, 16, 3, 64, 9, 1350
k = [torch.randn(blocks, bs, kv_heads, d) for _ in range(layers)]
v = [torch.randn(blocks, bs, kv_heads, d) for _ in range(layers)]
width = (ctx + bs - 1) // bs
out = {}
for name, rows, shared, new in cases:
    perm = torch.randperm(blocks).tolist()
    common, own = perm[:shared // bs], iter(perm[shared // bs:])
    seqs = ([1280 + new] if new else []) + [ctx] * rows  # the extend's sequence first
    lens = torch.tensor(seqs)
    tables = torch.tensor([common + [next(own) for _ in range(width - len(common))] for _ in seqs])
    if new:
        starts = torch.tensor([0] + [new + i for i in range(rows + 1)])
        q = torch.randn(new + rows, heads, d)
        call = lambda layer: cpu_lib.paged_extend_attention(q, k[layer], v[layer], tables, lens, starts, 0.125,
                                                            isa=isa, threads=threads)
    else:
        q = torch.randn(rows, heads, d)
        call = lambda layer: cpu_lib.paged_decode_attention(q, k[layer], v[layer], tables, lens, 0.125,
                                                            isa=isa, threads=threads)
    times = []
    for _ in range(25):
        t = time.perf_counter()
        for layer in range(layers):
            call(layer)
        times.append(time.perf_counter() - t)
    out[name] = statistics.median(times) * 1000
print(json.dumps(out))
'''


def measure(lib: Path, isa: str, blocks: int, threads: int, checkout: Path | None) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(checkout)) if checkout else None
    done = subprocess.run([sys.executable, "-c", _ONE, str(lib), isa, str(blocks), str(threads), json.dumps(CASES)],
                          capture_output=True, text=True, env=env, cwd=checkout)
    if done.returncode:
        raise SystemExit(f"{lib} ({isa}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--base-checkout", type=Path, help="import the base's pdserve_kernels from this checkout")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu-attention-ab.json")
    args = p.parse_args(argv)
    from pdserve_kernels import cpu_lib
    isas = [isa for isa in ("avx512", "avx2") if cpu_lib.isa_supported(isa)]
    runs = []
    for isa in isas:
        for blocks in (2000, 400):
            for r in range(args.rounds):
                for label, lib, checkout in (("base", args.base, args.base_checkout), ("new", args.new, None)):
                    ms = measure(lib, isa, blocks, args.threads, checkout)
                    runs.append({"isa": isa, "blocks": blocks, "round": r, "build": label, "ms": ms})
                    print(f"{isa} {blocks} blocks, round {r + 1}, {label}: "
                          + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), flush=True)
    rows = []
    for isa in isas:
        for blocks in (2000, 400):
            for name, *_ in CASES:
                base = [x["ms"][name] for x in runs if (x["isa"], x["blocks"], x["build"]) == (isa, blocks, "base")]
                new = [x["ms"][name] for x in runs if (x["isa"], x["blocks"], x["build"]) == (isa, blocks, "new")]
                rows.append([isa, blocks, name, f"{min(base):.2f}–{max(base):.2f}", f"{min(new):.2f}–{max(new):.2f}",
                             f"{min(base) / min(new):.2f}x"])
    print()
    print(table(["isa", "pool blocks", "case", "base ms (30 layers)", "new ms", "speedup (best)"], rows))
    write_json(args.out, {"benchmark": "cpu-attention-ab", "args": vars(args), "environment": environment(),
                          "runs": runs})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
