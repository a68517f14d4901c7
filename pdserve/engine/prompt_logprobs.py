"""Prompt logprobs: the log-probability of each prompt token given the tokens before it (what
OpenAI's legacy completions return with ``echo`` and ``logprobs``, and vLLM's
``prompt_logprobs``), computed chunk by chunk during the prefill.

The hidden state at position p predicts token p + 1, so a chunk of positions [start, end)
yields the entries of tokens start + 1 .. end: the entry of a chunk's first token came from
the previous chunk's last position, and the prompt's last position is left to the sampler (it
predicts the first output). The first prompt token has no entry (None). The values are the
model's own distribution: a log-softmax of the raw logits, before any penalty, bias,
temperature or grammar.

Which rows are computed is a function of the batch (every TP rank computes the same logits,
since the LM head's all_gather is a collective); only rank 0 keeps the values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence, TokenLogprobs

ROWS_PER_PASS = 256  # logits of this many positions at a time: [rows, vocab] floats


@dataclass
class PromptRows:
    """One chunk's positions whose next prompt token wants its logprob."""

    seq: Sequence
    start: int          # the chunk's first position
    rows: list[int]     # their rows among the forward's hidden states
    targets: list[int]  # the prompt token each row predicts


def prompt_rows(batch: list[tuple[Sequence, int, int]], query_start_loc: list[int]) -> list[PromptRows]:
    """The rows of `batch` (chunks (seq, start, n)) that carry prompt logprobs."""
    out = []
    for i, (seq, start, n) in enumerate(batch):
        p = len(seq.prompt_ids)
        if not seq.wants_prompt_logprobs or start >= p:
            continue
        end = min(start + n, p - 1)  # position p - 1 predicts the first output: the sampler's row
        base = query_start_loc[i] - start
        out.append(PromptRows(seq, start, [base + q for q in range(start, end)],
                              seq.prompt_ids[start + 1:end + 1]))
    return out


def compute_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, items: list[PromptRows],
                            keep: bool) -> None:
    """Append each chunk's entries to its sequence's `prompt_logprobs` (when `keep`: rank 0).
    Every rank runs the same LM-head passes (their all_gather is a collective)."""
    rows = [r for item in items for r in item.rows]
    targets = [t for item in items for t in item.targets]
    owner = [k for k, item in enumerate(items) for _ in item.rows]
    if keep:
        for item in items:
            if item.start == 0:  # a fresh prefill (a recompute starts over)
                item.seq.prompt_logprobs = [None]
    top_n = max((item.seq.params.prompt_logprobs or 0) for item in items) if items else 0
    for k in range(0, len(rows), ROWS_PER_PASS):
        index = torch.tensor(rows[k:k + ROWS_PER_PASS], device=hidden.device)
        logits = model.compute_logits(hidden[index])
        if not keep:
            continue
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = torch.tensor(targets[k:k + ROWS_PER_PASS], device=lp.device)
        values = lp.gather(1, chosen[:, None])[:, 0].tolist()
        top = lp.topk(top_n, dim=-1) if top_n else None
        top_ids = top.indices.tolist() if top is not None else None
        top_values = top.values.tolist() if top is not None else None
        for j, value in enumerate(values):
            seq = items[owner[k + j]].seq
            n = seq.params.prompt_logprobs or 0
            pairs = list(zip(top_ids[j][:n], top_values[j][:n])) if top_ids is not None and n else []
            seq.prompt_logprobs.append(TokenLogprobs(targets[k + j], value, pairs))
