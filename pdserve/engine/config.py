"""Engine settings: one dataclass, built from keyword arguments or CLI flags."""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None            # model directory, a .gguf file, or None/"default"
    dtype: str = "auto"                 # auto: float32 on CPU, bfloat16 on GPU
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory: int = 256 << 20    # bytes of KV pool (per rank)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512   # chunked-prefill token budget per step
    max_model_len: int | None = None    # default: the model's max_position_embeddings
    threads: int = 0                    # torch CPU threads (0: leave torch's setting; the CLI gives the cores' share)
    kernels: str = "auto"               # op backend: auto | torch | native (see pdserve_kernels)
    nvfp4_mode: str = "auto"            # NVFP4 checkpoints: auto | w4a16 | w4a4
    quantization: str = "none"          # none | auto | gguf | int8 | int4 (pdserve.weights.quantization)
    index_cache_dtype: str = "bfloat16"  # DSA index keys (DeepSeek-V3.2, GLM-5): bfloat16 | fp8 | float32

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
        return DTYPES[self.dtype]
