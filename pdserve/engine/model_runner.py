"""ModelRunner: one forward over a scheduled batch, then sampling.

With overlap (scheduler/lockstep.py) a run is split in two: `stage` builds the inputs on the
loop thread, the job it returns runs the forward and samples on the forward thread. A decode
chunk may then end on a placeholder: a position past the tokens the sequence knows, whose token
the previous forward sampled (rank 0 has it; other TP ranks get it by a broadcast).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.kvcache import KVPool
from pdserve.layers.attention import AttentionMetadata
from pdserve.scheduler.plan import SampledToken
from pdserve.structured import Grammars

from .cuda_graphs import DecodeGraphs, PromptGraphs
from .prompt_logprobs import compute_prompt_logprobs, prompt_rows
from .sampler import GrammarMasks, prepare_masks, sample
from .sequence import Sequence


@dataclass
class Placeholders:
    """Rows of a batch's input ids whose tokens the previous forward sampled. `tokens`: their
    values on rank 0 (None on other ranks, which receive them)."""

    rows: list[int]
    tokens: list[int] | None


@dataclass
class StagedBatch:
    """A batch's inputs, built on the loop thread, for one forward (+ sampling)."""

    batch: list[tuple[Sequence, int, int]]
    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    ends: list[int]                 # rows of the batch whose chunk samples
    sample_tokens: bool
    masks: GrammarMasks | None
    placeholders: Placeholders | None = None


class ModelRunner:
    """Owns the model and its KV pool; turns (seq, start, num_tokens) chunks into sampled tokens.
    `tp` (the model's group) carries the placeholders' tokens to the other ranks (overlap)."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, device: str = "cpu", tp=None):
        self.model, self.pool, self.device, self.tp = model, pool, device, tp
        self.grammars: Grammars | None = None  # for constrained requests (the engine sets it)
        self.graphs: DecodeGraphs | None = None  # decode steps as CUDA graphs (the engine sets it)
        self.prompt_graphs: PromptGraphs | None = None  # the other steps, piecewise (likewise)

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
        # non_blocking: on a GPU, CUDA stages pageable bytes before returning, so these copies
        # never wait for kernels still running (on a CPU it changes nothing)
        flat = torch.tensor(ids + positions + slots, dtype=torch.long).to(self.device, non_blocking=True)
        table_t = torch.tensor(tables, dtype=torch.long).to(self.device, non_blocking=True)
        meta = AttentionMetadata(starts, lens, table_t, flat[2 * t:], self.pool.layers)
        return flat[:t], flat[t:2 * t], meta

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int, int]], sample_tokens: bool = True) -> list[SampledToken]:
        """Forward the batch; sample for every sequence whose chunk reached its last token.

        Every TP rank computes the logits (the LM head's all_gather is a collective); only the
        rank that plans (`sample_tokens`) samples and keeps prompt logprobs (prompt_logprobs.py)."""
        if not batch:
            return []
        return self.execute(self.prepare(batch, sample_tokens))

    def stage(self, batch: list[tuple[Sequence, int, int]], sample_tokens: bool,
              previous: list[SampledToken]) -> Callable[[], list[SampledToken]]:
        """Overlap: build the batch's inputs now (loop thread); the job returned runs the forward
        (forward thread). `previous`: rank 0's tokens of the previous forward, for placeholders."""
        staged = self.prepare(batch, sample_tokens, previous)
        return lambda: self.execute(staged)

    def prepare(self, batch: list[tuple[Sequence, int, int]], sample_tokens: bool,
                previous: list[SampledToken] | None = None) -> StagedBatch:
        ids, positions, meta = self.metadata(batch)
        # a chunk samples when it reaches the sequence's end (overlap: ends past it, on a placeholder)
        ends = [i for i, (seq, start, n) in enumerate(batch) if start + n >= seq.num_tokens]
        # constrained requests: their grammar masks are computed in a thread while the forward runs
        masks = prepare_masks([batch[i][0] for i in ends], self.grammars) if sample_tokens else None
        staged = StagedBatch(batch, ids, positions, meta, ends, sample_tokens, masks)
        rows, row = [], 0
        for seq, start, n in batch:
            if start + n > seq.num_tokens:  # only its last token can be one (scheduler.py)
                rows.append(row + n - 1)
            row += n
        if rows:
            tokens = None
            if previous is not None and (sample_tokens or self.tp is None or self.tp.size == 1):
                last = {t.request_id: t.token_id for t in previous}
                wanted = [seq.request_id for seq, start, n in batch if start + n > seq.num_tokens]
                missing = [rid for rid in wanted if rid not in last]
                if missing:
                    raise RuntimeError(f"placeholders without a token from the previous forward: {missing}")
                tokens = [last[rid] for rid in wanted]
                ids[rows] = torch.tensor(tokens, dtype=ids.dtype).to(ids.device, non_blocking=True)
            staged.placeholders = Placeholders(rows, tokens)
        return staged

    @torch.inference_mode()
    def execute(self, staged: StagedBatch) -> list[SampledToken]:
        """The forward of a staged batch, then sampling (rank 0)."""
        batch, ids, positions, meta = staged.batch, staged.ids, staged.positions, staged.meta
        ends, masks, sample_tokens = staged.ends, staged.masks, staged.sample_tokens
        ph = staged.placeholders
        if ph is not None and self.tp is not None and self.tp.size > 1:
            # rank 0's tokens to every rank: on the model's group, the forward's first collective
            values = torch.tensor(ph.tokens if ph.tokens is not None else [0] * len(ph.rows), dtype=torch.long)
            self.tp.broadcast(values)
            ids[ph.rows] = values.to(ids.device, non_blocking=True)
        hidden = self.graphs.forward(ids, positions, meta) if self.graphs is not None else None
        if hidden is None and self.prompt_graphs is not None:
            hidden = self.prompt_graphs.forward(ids, positions, meta)
        if hidden is None:
            hidden = self.model(ids, positions, meta)
        wanted = prompt_rows(batch, meta.query_start_loc)
        if wanted:  # echo/prompt_logprobs: logits at every prompt position of these chunks
            compute_prompt_logprobs(self.model, hidden, wanted, keep=sample_tokens)
        if not ends:
            return []
        if len(ends) == hidden.shape[0]:  # decode: every row is a sequence's last token
            last_hidden = hidden
        else:
            last = torch.tensor([meta.query_start_loc[i + 1] - 1 for i in ends]).to(self.device, non_blocking=True)
            last_hidden = hidden[last]
        logits = self.model.compute_logits(last_hidden)
        if not sample_tokens:
            return []
        seqs = [batch[i][0] for i in ends]
        # the token sampled after a chunk is its sequence's token number start + n (overlap: the
        # chunk may end on a placeholder, which output_ids does not hold yet)
        outputs = [batch[i][1] + batch[i][2] - len(batch[i][0].prompt_ids) for i in ends]
        sampled = sample(logits, seqs, self.grammars, masks, outputs)
        return [SampledToken(seq.request_id, tok, lp) for seq, (tok, lp) in zip(seqs, sampled)]


def _tokens(seq: Sequence, start: int, n: int) -> list[int]:
    """Token ids start..start+n of `seq` without copying its whole history (decode reads one).
    Positions past its known tokens (overlap placeholders) read 0 until they are filled."""
    if start + n > seq.num_tokens:
        known = max(0, seq.num_tokens - start)
        return _tokens(seq, start, known) + [0] * (n - known)
    p = len(seq.prompt_ids)
    if start >= p:
        return seq.output_ids[start - p:start - p + n]
    if start + n <= p:
        return seq.prompt_ids[start:start + n]
    return seq.prompt_ids[start:] + seq.output_ids[:start + n - p]
