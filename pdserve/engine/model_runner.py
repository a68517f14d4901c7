"""ModelRunner: one forward over a scheduled batch, then sampling."""
from __future__ import annotations

import torch

from pdserve.kvcache import KVPool
from pdserve.layers.attention import AttentionMetadata
from pdserve.scheduler.plan import SampledToken
from pdserve.structured import Grammars

from .prompt_logprobs import compute_prompt_logprobs, prompt_rows
from .sampler import prepare_masks, sample
from .sequence import Sequence


class ModelRunner:
    """Owns the model and its KV pool; turns (seq, start, num_tokens) chunks into sampled tokens."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, device: str = "cpu"):
        self.model, self.pool, self.device = model, pool, device
        self.grammars: Grammars | None = None  # for constrained requests (the engine sets it)

    def metadata(self, batch: list[tuple[Sequence, int, int]]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of a batch of chunks.

        Built from Python lists into two tensors (ids, positions and slots in one, the padded
        block tables in the other), each moved to the device with one copy: per step, the cost
        is a few list operations per token and no per-sequence tensor."""
        bs = self.pool.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, lens = [0], []
        width = max(len(seq.block_table) for seq, _, _ in batch)
        tables = []
        for seq, start, n in batch:
            ids += _tokens(seq, start, n)
            positions += range(start, start + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            starts.append(starts[-1] + n)
            lens.append(start + n)
            tables.append(table + [0] * (width - len(table)))
        t = len(ids)
        flat = torch.tensor(ids + positions + slots, dtype=torch.long).to(self.device)
        meta = AttentionMetadata(starts, lens, torch.tensor(tables, dtype=torch.long).to(self.device),
                                 flat[2 * t:], self.pool.layers)
        return flat[:t], flat[t:2 * t], meta

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int, int]], sample_tokens: bool = True) -> list[SampledToken]:
        """Forward the batch; sample for every sequence whose chunk reached its last token.

        Every TP rank computes the logits (the LM head's all_gather is a collective); only the
        rank that plans (`sample_tokens`) samples and keeps prompt logprobs (prompt_logprobs.py)."""
        if not batch:
            return []
        ids, positions, meta = self.metadata(batch)
        ends = [i for i, (seq, start, n) in enumerate(batch) if start + n == seq.num_tokens]
        # constrained requests: their grammar masks are computed in a thread while the forward runs
        masks = prepare_masks([batch[i][0] for i in ends], self.grammars) if sample_tokens else None
        hidden = self.model(ids, positions, meta)
        wanted = prompt_rows(batch, meta.query_start_loc)
        if wanted:  # echo/prompt_logprobs: logits at every prompt position of these chunks
            compute_prompt_logprobs(self.model, hidden, wanted, keep=sample_tokens)
        if not ends:
            return []
        if len(ends) == hidden.shape[0]:  # decode: every row is a sequence's last token
            last_hidden = hidden
        else:
            last = torch.tensor([meta.query_start_loc[i + 1] - 1 for i in ends], device=self.device)
            last_hidden = hidden[last]
        logits = self.model.compute_logits(last_hidden)
        if not sample_tokens:
            return []
        seqs = [batch[i][0] for i in ends]
        sampled = sample(logits, seqs, self.grammars, masks)
        return [SampledToken(seq.request_id, tok, lp) for seq, (tok, lp) in zip(seqs, sampled)]


def _tokens(seq: Sequence, start: int, n: int) -> list[int]:
    """Token ids start..start+n of `seq` without copying its whole history (decode reads one)."""
    p = len(seq.prompt_ids)
    if start >= p:
        return seq.output_ids[start - p:start - p + n]
    if start + n <= p:
        return seq.prompt_ids[start:start + n]
    return seq.prompt_ids[start:] + seq.output_ids[:start + n - p]
