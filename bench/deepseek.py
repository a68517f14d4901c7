"""The DeepSeek family (MLA + MoE + DSA): KV-cache bytes per token, and CPU decode speed.

    python bench/deepseek.py [--batch-sizes 1,32] [--input-len 128] [--output-len 32] [--no-decode]

1. KV-cache bytes per token (all layers, bf16 cache) of DeepSeek-V3, DeepSeek-V3.2 and GLM-5 at
   their published sizes (transformers' default configs) and of the ≈100M GLM-5-shaped model
   below, next to Llama models of similar size: what one token of context costs in the paged
   pool and on the wire of a PD transfer.
2. Decode: a random ≈100M-parameter GLM-5-shaped model (MLA, 32 experts top-4, DSA with
   index_topk below the context length) through bench/offline.py — pdserve's engine against
   transformers `generate()` on the same weights, at each batch size.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

import offline
from common import RESULTS, int_list, table, write_json

# ≈100M parameters, GLM-5's shape scaled down: 1 dense layer then MoE, DSA in every layer
SMALL_GLM5 = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
                  num_hidden_layers=6, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
                  q_lora_rank=256, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                  n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=1, index_n_heads=8,
                  index_head_dim=64, index_topk=64, max_position_embeddings=4096, eos_token_id=2,
                  bos_token_id=1)
LLAMAS = {  # similar sizes: (layers, KV heads, head dim)
    "Llama-3.1-405B": (126, 8, 128),
    "Llama-3.1-70B": (80, 8, 128),
    "SmolLM2-135M (≈100M)": (30, 3, 64),
}


def kv_rows() -> list[list[object]]:
    import transformers

    from pdserve.kvcache import KVPool
    from pdserve.models.deepseek import DeepseekConfig, cache_spec

    rows = []
    configs = {"DeepSeek-V3 (671B)": (transformers.DeepseekV3Config(), {}),
               "DeepSeek-V3.2 (671B)": (transformers.DeepseekV32Config(), {}),
               "GLM-5 (744B)": (transformers.GlmMoeDsaConfig(), {}),
               # the indexer runs on every 4th layer, the others reuse its top-k (no index keys)
               "GLM-5, index_topk_freq 4": (transformers.GlmMoeDsaConfig(),
                                            {"indexer_types": None, "index_topk_freq": 4,
                                             "index_skip_topk_offset": 3}),
               "GLM-5-shaped ≈100M": (transformers.GlmMoeDsaConfig(**SMALL_GLM5), {})}
    for name, (hf, overrides) in configs.items():
        cfg = hf.to_dict() | overrides
        cfg["architectures"] = hf.architectures or [type(hf).__name__.replace("Config", "ForCausalLM")]
        c = DeepseekConfig.from_hf(cfg)
        for index_dtype, label in ((torch.bfloat16, "bf16 index keys"), (torch.float8_e4m3fn, "fp8 index keys")):
            specs = cache_spec(c, torch.bfloat16, index_dtype)
            kinds: dict[str, int] = {}  # each distinct layer layout → how many layers have it
            for layer in specs:
                key = " + ".join(f"{s.name} {s.bytes_per_token()}" for s in layer)
                kinds[key] = kinds.get(key, 0) + 1
            rows.append([name, label if c.indexer_types else "-", c.num_layers,
                         "; ".join(f"{k} ({n} layers)" for k, n in kinds.items()),
                         KVPool.bytes_per_token(specs)])
            if not c.indexer_types:
                break
    for name, (layers, kv_heads, head_dim) in LLAMAS.items():
        per = 2 * kv_heads * head_dim * 2
        rows.append([name, "-", layers, f"k+v {per} ({layers} layers)", layers * per])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int_list, default=[1, 32])
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (above index_topk=64)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-decode", action="store_true", help="only the KV bytes table")
    p.add_argument("--model-dir", type=Path, default=RESULTS / "glm5-100m", help="where the random model goes")
    args = p.parse_args(argv)

    rows = kv_rows()
    headers = ["model", "index keys", "layers", "bytes per token per layer", "KV bytes per token"]
    print("KV cache per token (bf16 cache):")
    print(table(headers, rows))
    write_json(RESULTS / "deepseek_kv_bytes.json", {"benchmark": "deepseek_kv_bytes",
                                                    "rows": [dict(zip(headers, r)) for r in rows]})
    if args.no_decode:
        return 0
    import transformers

    if not (args.model_dir / "config.json").exists():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.GlmMoeDsaConfig(**SMALL_GLM5),
                                                              dtype=torch.float32)
        print(f"GLM-5-shaped model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
        model.save_pretrained(args.model_dir)
        # the engine wants a tokenizer; the default model's covers the first 32000 ids
        from pdserve.weights import resolve_model_path
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(resolve_model_path(None) / name, args.model_dir / name)
    return offline.main(["--model", str(args.model_dir), "--batch-sizes", ",".join(map(str, args.batch_sizes)),
                         "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                         "--threads", str(args.threads), "--out", str(RESULTS / "deepseek_decode.json")])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
