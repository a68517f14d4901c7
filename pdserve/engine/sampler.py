"""Turns last-position logits into next tokens, one row per sequence.

Order: logit bias and min_tokens masking, then repetition/presence/frequency penalties (the
logprobs reported are taken here, before temperature), then temperature, top-k, top-p, min-p,
and a draw from the sequence's own generator when it has a seed (reproducible per request).
"""
from __future__ import annotations

import torch

from pdserve.engine.sequence import Sequence, TokenLogprobs


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprobs | None]]:
    """Sample one token for each row of `logits` `[len(seqs), vocab]`."""
    if all(_plain_greedy(seq) for seq in seqs):  # the common case: one argmax for the batch
        return [(token, None) for token in logits.argmax(dim=-1).tolist()]
    logits = logits.float().clone()
    out = []
    for i, seq in enumerate(seqs):
        row = _adjust(logits[i], seq)
        token = _draw(row, seq)
        out.append((token, _logprobs(row, token, seq.params.logprobs)))
    return out


def _plain_greedy(seq: Sequence) -> bool:
    """Greedy with nothing that changes the logits and no logprobs: the argmax is the token."""
    p = seq.params
    return (p.greedy and p.logprobs is None and not p.logit_bias and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty
            and (len(seq.output_ids) >= p.min_tokens))


def _adjust(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        valid = ids < row.numel()
        row[ids[valid]] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)[valid]
    if len(seq.output_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
        if banned:
            row[list(banned)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_ids) | set(seq.output_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_ids:
        counts = torch.bincount(torch.tensor(seq.output_ids), minlength=row.numel())[:row.numel()]
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return row


def _draw(row: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    if p.greedy:
        return int(row.argmax())
    row = row / p.temperature
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
    return int(torch.multinomial(probs, 1, generator=seq.generator))


def _logprobs(row: torch.Tensor, token: int, top_n: int | None) -> TokenLogprobs | None:
    if top_n is None:
        return None
    lp = torch.log_softmax(row, dim=-1)
    top = torch.topk(lp, top_n) if top_n else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return TokenLogprobs(token, float(lp[token]), pairs)
