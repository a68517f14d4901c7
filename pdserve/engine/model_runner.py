"""ModelRunner: one forward over a scheduled batch, then sampling."""
from __future__ import annotations

import torch

from pdserve.kvcache import KVPool
from pdserve.layers.attention import AttentionMetadata
from pdserve.scheduler.plan import SampledToken

from .sampler import sample
from .sequence import Sequence


class ModelRunner:
    """Owns the model and its KV pool; turns (seq, start, num_tokens) chunks into sampled tokens."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, device: str = "cpu"):
        self.model, self.pool, self.device = model, pool, device

    def metadata(self, batch: list[tuple[Sequence, int, int]]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of a batch of chunks."""
        bs = self.pool.block_size
        ids, positions, slots, starts, lens = [], [], [], [0], []
        for seq, start, n in batch:
            tokens = seq.token_ids
            ids += tokens[start:start + n]
            positions += range(start, start + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            starts.append(starts[-1] + n)
            lens.append(start + n)
        width = max(len(seq.block_table) for seq, _, _ in batch)
        tables = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (seq, _, _) in enumerate(batch):
            tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table)
        dev = self.device
        meta = AttentionMetadata(starts, lens, tables.to(dev), torch.tensor(slots, device=dev),
                                 self.pool.layers)
        return torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int, int]], sample_tokens: bool = True) -> list[SampledToken]:
        """Forward the batch; sample for every sequence whose chunk reached its last token.

        Every TP rank computes the logits (the LM head's all_gather is a collective); only the
        rank that plans (`sample_tokens`) samples."""
        if not batch:
            return []
        ids, positions, meta = self.metadata(batch)
        hidden = self.model(ids, positions, meta)
        ends = [i for i, (seq, start, n) in enumerate(batch) if start + n == seq.num_tokens]
        if not ends:
            return []
        last = torch.tensor([meta.query_start_loc[i + 1] - 1 for i in ends], device=self.device)
        logits = self.model.compute_logits(hidden[last])
        if not sample_tokens:
            return []
        seqs = [batch[i][0] for i in ends]
        return [SampledToken(seq.request_id, tok, lp) for seq, (tok, lp) in zip(seqs, sample(logits, seqs))]
