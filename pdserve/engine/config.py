"""Engine settings: one dataclass, built from keyword arguments or CLI flags."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16}  # --kv-cache-dtype besides auto


@dataclass
class EngineConfig:
    model: str | None = None            # model directory, a .gguf file, or None/"default"
    dtype: str = "auto"                 # auto: float32 on CPU, bfloat16 on GPU
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes of KV pool per rank; None: auto (see fit_context)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512   # chunked-prefill token budget per step
    max_prefill_tokens: int | None = None  # of it, prompt tokens beside a sampled token; None: auto (prefill_budget)
    first_token_slack: int | None = None  # prompt tokens after a prompt's last chunk; None: auto (first_token_budget)
    max_model_len: int | None = None    # default: the model's max_position_embeddings
    threads: int = 0                    # torch CPU threads (0: leave torch's setting; the CLI gives the cores' share)
    kernels: str = "auto"               # op backend: auto | torch | native (see pdserve_kernels)
    nvfp4_mode: str = "auto"            # NVFP4 checkpoints: auto | w4a16 | w4a4
    quantization: str = "none"          # none | auto | gguf | int8 | int4 (pdserve.weights.quantization)
    index_cache_dtype: str = "bfloat16"  # DSA index keys (DeepSeek-V3.2, GLM-5): bfloat16 | fp8 | float32
    kv_cache_dtype: str = "auto"        # K/V in the cache: auto (the compute dtype) | float32 | float16 (CPU)
    prefix_cache: bool = True           # reuse cached KV blocks of shared prompt prefixes (--no-prefix-cache)
    host_cache_memory: int = 0          # bytes of host memory for evicted cached blocks (0: no second tier)
    overlap: bool = False               # plan step N+1 while step N's forward runs (docs/overlap.md)
    cuda_graphs: bool = True            # on CUDA, steps replay captured graphs (docs/gpu.md)
    # a server's longest wait for a finished request's next turn before decode-only steps
    # (docs/follow-ups.md); 0: never (the offline engine); None: auto (follow_up_wait)
    follow_up_wait_ms: float | None = 0.0

    def prefill_budget(self) -> int | None:
        """Prompt tokens a step may compute beside a token it samples (a decode's, a prompt's
        first): SchedulerConfig.max_prefill_tokens.

        Unset: CPU_PREFILL_TOKENS on a CPU, where a step's time grows with its tokens almost in
        proportion, so the bound keeps the gap between a stream's tokens short at little cost
        in throughput; on a GPU no bound but max_num_batched_tokens (a step's fixed cost
        dominates there). Measurements: docs/step-budget.md."""
        if self.max_prefill_tokens is not None:
            if self.max_prefill_tokens < 1:
                raise ValueError(f"max_prefill_tokens must be at least 1, not {self.max_prefill_tokens}")
            return self.max_prefill_tokens
        return CPU_PREFILL_TOKENS if self.device.startswith("cpu") else None

    def first_token_budget(self) -> int | None:
        """Prompt tokens a step may take for other prompts once it computes a prompt's last
        chunk (that prompt's first output): SchedulerConfig.first_token_slack.

        Unset: CPU_FIRST_TOKEN_SLACK on a CPU, where each of those tokens holds the first output
        back by its own cost and a step's fixed part is small; on a GPU none (there the fixed
        part dominates, and prompts finishing together share it). docs/step-budget.md."""
        if self.first_token_slack is not None:
            if self.first_token_slack < 0:
                raise ValueError(f"first_token_slack must be at least 0, not {self.first_token_slack}")
            return self.first_token_slack
        return CPU_FIRST_TOKEN_SLACK if self.device.startswith("cpu") else None

    def follow_up_wait(self) -> float:
        """Seconds a step may wait for a finished request's follow-up (scheduler/follow_ups.py).

        Unset: CPU_FOLLOW_UP_WAIT_MS on a CPU, where a turn's prompt step is several decode steps
        long, so a turn that queues behind another's waits for most of one; none on a GPU, where
        those steps are short and a wait would cost the decode streams more than it saves."""
        ms = self.follow_up_wait_ms
        if ms is None:
            ms = CPU_FOLLOW_UP_WAIT_MS if self.device.startswith("cpu") else 0.0
        if ms < 0:
            raise ValueError(f"follow_up_wait_ms must be at least 0, not {ms}")
        return ms / 1000

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
        return DTYPES[self.dtype]

    def kv_torch_dtype(self) -> torch.dtype:
        """What the KV cache holds (docs/kv-cache-dtype.md): the compute dtype, or fp16 on a CPU,
        where the kernels widen it back to fp32 exactly and a step reads half the bytes."""
        if self.kv_cache_dtype == "auto":
            return self.torch_dtype()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose auto or one of "
                             f"{sorted(KV_CACHE_DTYPES)}")
        if not self.device.startswith("cpu") and KV_CACHE_DTYPES[self.kv_cache_dtype] != self.torch_dtype():
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} is for CPU workers; on {self.device} "
                             f"the cache holds the compute dtype ({self.torch_dtype()}): use auto")
        return KV_CACHE_DTYPES[self.kv_cache_dtype]


CPU_PREFILL_TOKENS = 256  # prompt tokens beside a sampled token, by default on a CPU (docs/step-budget.md)
CPU_FIRST_TOKEN_SLACK = 16  # prompt tokens after a prompt's last chunk, by default on a CPU (the same)
# a server's wait for a follow-up, by default on a CPU: a turn comes back through the router and
# its client in 5-13 ms on loopback (docs/follow-ups.md)
CPU_FOLLOW_UP_WAIT_MS = 20.0
# The least an automatic KV pool gets (per rank): 1 GiB holds 32 streams of the default model at
# ~700 tokens each; at 256 MiB (360 with the context) 32 streams of ~330 tokens already preempted
# each other, and the recomputes made the 32-stream ITL p99 (docs/step-budget.md).
AUTO_KV_MEMORY = 1 << 30
AUTO_KV_LIMIT = 4 << 30     # an automatic pool grows to hold one full context up to this size


class ContextDoesNotFit(ValueError):
    """An explicit max_model_len larger than an explicit KV pool: refused at start."""


@dataclass(frozen=True)
class ContextFit:
    """The KV pool's size and the context length the worker serves, reconciled."""

    num_blocks: int
    max_model_len: int


def fit_context(config: EngineConfig, bytes_per_block: int, model_len: int) -> ContextFit:
    """Size the KV pool and the context so that one request at the full context always fits.

    A request of max_model_len tokens that could not fit the pool even alone would fail (or
    preempt itself forever) after being admitted, so the two are reconciled here, at start-up:

    * no --kv-cache-memory: the pool holds the context once (at least AUTO_KV_MEMORY, at most
      AUTO_KV_LIMIT);
    * a pool smaller than the context: max_model_len is lowered to what it holds (logged), unless
      --max-model-len was given, which is refused (``ContextDoesNotFit``), as vLLM does.
    """
    bs = config.block_size
    target = config.max_model_len or model_len
    needed = -(-target // bs)
    memory = config.kv_cache_memory
    if memory is None:
        memory = max(AUTO_KV_MEMORY, min(needed * bytes_per_block, AUTO_KV_LIMIT))
    num_blocks = memory // bytes_per_block
    capacity = num_blocks * bs
    if capacity >= target:
        return ContextFit(num_blocks, target)
    hint = f"--kv-cache-memory {-(-needed * bytes_per_block // (1 << 20))}MiB"
    if config.max_model_len is not None:
        raise ContextDoesNotFit(
            f"--max-model-len {target} does not fit the KV pool ({num_blocks} blocks x {bs} = {capacity} "
            f"tokens); give {hint} or more, or --max-model-len {capacity} or less")
    logger.warning("max_model_len lowered from %d to %d: the KV pool (%d blocks x %d tokens) holds no "
                   "more; %s would keep the model's context", target, capacity, num_blocks, bs, hint)
    return ContextFit(num_blocks, capacity)
