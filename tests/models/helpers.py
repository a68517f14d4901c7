"""Run a pdserve model directly over a paged cache (no scheduler), for reference comparisons."""
from __future__ import annotations

import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.kvcache import BlockAllocator, KVPool


def all_logits(model: torch.nn.Module, ids: list[int], chunk: int | None = None, block_size: int = 4
               ) -> torch.Tensor:
    """Logits at every position of `ids`, computed in chunks of `chunk` tokens through the cache."""
    specs = model.cache_spec(torch.float32)
    n_blocks = -(-len(ids) // block_size) + 1
    pool = KVPool(model.num_layers, specs, n_blocks, block_size)
    runner = ModelRunner(model, pool)
    seq = Sequence("r", list(ids), SamplingParams())
    seq.block_table = BlockAllocator(n_blocks).allocate(n_blocks)
    chunk = chunk or len(ids)
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            tok, pos, meta = runner.metadata([(seq, start, n)])
            out.append(model.compute_logits(model(tok, pos, meta)))
    return torch.cat(out)
