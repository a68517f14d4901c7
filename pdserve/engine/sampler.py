"""Turns last-position logits into next tokens, one row per sequence.

Order: the grammar mask of constrained sequences (``pdserve.structured``: every later step,
logprobs included, sees the masked distribution; EOS only where the grammar accepts), logit
bias and min_tokens masking, then repetition/presence/frequency penalties (the
logprobs reported are taken here, before temperature), then temperature, top-k, top-p, min-p,
and a draw. A seeded sequence's draw number i comes from its own generator, seeded with
(seed, i): so a choice draws alike wherever its tokens are sampled (colocated; its first token
on a prefill worker and the rest on a decode worker; resumed elsewhere after a worker failed).

Penalties and grammars read ``Sequence.generated_ids``: with a resumed choice, that includes the
output of its earlier attempt, which arrives as the end of the prompt.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from pdserve.engine.sequence import Sequence, TokenLogprobs
from pdserve.structured import Grammars
from pdserve.structured.bitmask import apply_bitmask, new_bitmask

logger = logging.getLogger(__name__)


@dataclass
class GrammarMasks:
    """The bitmasks of a batch's constrained rows, being computed (``prepare_masks``)."""

    rows: list[int]       # the rows of the logits they belong to
    job: Future           # → (bitmask [len(rows), words], seconds it took)


def prepare_masks(seqs: list[Sequence], grammars: Grammars | None) -> GrammarMasks | None:
    """Start computing the grammar bitmasks of the constrained `seqs` in the grammars' thread,
    so that they overlap the forward (the backend releases the GIL); None when none is
    constrained: unconstrained batches pay one pass over their params."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.structured is not None]
    if not rows:
        return None
    if grammars is None:
        raise RuntimeError("a constrained request reached a model runner without grammars")
    return GrammarMasks(rows, grammars.submit(_fill, [seqs[i] for i in rows], grammars))


def sample(logits: torch.Tensor, seqs: list[Sequence], grammars: Grammars | None = None,
           masks: GrammarMasks | None = None, outputs: list[int] | None = None,
           ) -> list[tuple[int, TokenLogprobs | None]]:
    """Sample one token for each row of `logits` `[len(seqs), vocab]`.

    `grammars` serves the constrained sequences (``params.structured``), whose bitmasks
    `masks` may already hold (else they are computed here); a batch without one takes none of
    that path. `outputs`: how many tokens each sequence output before this one (default: its
    ``output_ids``, which with overlap may not hold the newest token yet)."""
    if masks is None:
        masks = prepare_masks(seqs, grammars)
    if masks is not None:
        logits = logits.float().clone()
        bitmask, fill_s = masks.job.result()
        t0 = time.thread_time()
        apply_bitmask(logits, masks.rows, bitmask)
        if grammars is not None and grammars.observer is not None:
            grammars.observer.grammar_masked(fill_s + time.thread_time() - t0, len(masks.rows))
    if all(_plain_greedy(seq) for seq in seqs):  # the common case: one argmax for the batch
        return [(token, None) for token in logits.argmax(dim=-1).tolist()]
    if masks is None:
        logits = logits.float().clone()
    out = []
    for i, seq in enumerate(seqs):
        row = _adjust(logits[i], seq)
        token = _draw(row, seq, len(seq.output_ids) if outputs is None else outputs[i])
        out.append((token, _logprobs(row, token, seq.params.logprobs)))
    return out


def _fill(seqs: list[Sequence], grammars: Grammars) -> tuple[torch.Tensor, float]:
    """The bitmask of what each of `seqs`' grammars allows next. A matcher is started on first
    use and first catches up with its sequence's output (see ``GrammarState.sync``). The
    seconds returned are this thread's CPU time: the cost, whatever the forward beside it does."""
    t0 = time.thread_time()
    bitmask = new_bitmask(len(seqs), grammars.backend.vocab_size)
    for j, seq in enumerate(seqs):
        spec, output = seq.params.structured, seq.generated_ids
        if spec.start_after is not None:  # e.g. reasoning first: free until its end marker
            if spec.start_after not in output:
                continue  # the row stays all ones
            output = output[output.index(spec.start_after) + 1:]
        if seq.grammar is None:
            seq.grammar = grammars.start(spec)
        seq.grammar.sync(output)
        seq.grammar.matcher.fill_bitmask(bitmask, j)
        if seq.grammar.matcher.error is not None or not bitmask[j].any():  # cannot go on: end it
            logger.warning("request %s: the grammar allows nothing (%s); ending it", seq.request_id,
                           (seq.grammar.matcher.error or "no token").splitlines()[0])
            _only(bitmask, j, seq.eos_token_ids)
    return bitmask, time.thread_time() - t0


def _only(bitmask: torch.Tensor, row: int, token_ids: frozenset[int]) -> None:
    bitmask[row] = 0
    for t in token_ids:
        if t // 32 < bitmask.shape[1]:
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)


def _plain_greedy(seq: Sequence) -> bool:
    """Greedy with nothing that changes the logits and no logprobs: the argmax is the token."""
    p = seq.params
    return (p.greedy and p.logprobs is None and not p.logit_bias and p.allowed_token_ids is None
            and not p.bad_words_ids and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty
            and (len(seq.output_ids) >= p.min_tokens))


def _adjust(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.allowed_token_ids is not None:
        keep = torch.zeros(row.numel(), dtype=torch.bool, device=row.device)
        ids = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=row.device)
        keep[ids[ids < row.numel()]] = True  # the router checked them against the vocabulary
        row.masked_fill_(~keep, float("-inf"))
    if p.bad_words_ids:
        _ban_bad_words(row, p.bad_words_ids, seq.generated_ids)
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        valid = ids < row.numel()
        row[ids[valid]] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)[valid]
    if len(seq.output_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
        if banned:
            kept = row[list(banned)].clone()
            row[list(banned)] = float("-inf")
            if (p.structured is not None or p.allowed_token_ids is not None) and not torch.isfinite(row).any():
                row[list(banned)] = kept  # the grammar (or the allowed set) has only the end: it wins
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_ids) | set(seq.output_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and (generated := seq.generated_ids):
        counts = torch.bincount(torch.tensor(generated), minlength=row.numel())[:row.numel()]
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return row


def _ban_bad_words(row: torch.Tensor, words: list[list[int]], output: list[int]) -> None:
    """The last token of every word whose other tokens end the output so far (a one-token word:
    always) gets no mass."""
    for ids in words:
        head = ids[:-1]
        if ids[-1] < row.numel() and (not head or output[len(output) - len(head):] == head):
            row[ids[-1]] = float("-inf")


def _draw(row: torch.Tensor, seq: Sequence, output: int) -> int:
    p = seq.params
    if p.greedy:
        return int(row.argmax())
    unscaled, row = row, row / p.temperature
    if p.top_k and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= p.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        # a vanishing temperature overflows the scaled logits (inf - inf): the limit is greedy
        return int(unscaled.argmax())
    if seq.generator is not None:
        seq.generator.manual_seed(draw_seed(p.seed, p.resumed_tokens + output))
        if probs.device != seq.generator.device:
            # a request's generator is made on the CPU (with its sequence, before any device is
            # known): its draw runs there, so a seed draws alike on every device
            probs = probs.cpu()
    return int(torch.multinomial(probs, 1, generator=seq.generator))


_U64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of a seeded sequence's draw number `index` (splitmix64 of the pair:
    neighbouring seeds and indexes give unrelated streams)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _logprobs(row: torch.Tensor, token: int, top_n: int | None) -> TokenLogprobs | None:
    if top_n is None:
        return None
    lp = torch.log_softmax(row, dim=-1)
    top = torch.topk(lp, top_n) if top_n else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return TokenLogprobs(token, float(lp[token]), pairs)
