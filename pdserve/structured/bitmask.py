"""Packed token bitmasks → logits: a row's disallowed tokens become -inf.

A bitmask row is ``ceil(vocab / 32)`` int32 words, bit ``t % 32`` of word ``t // 32`` set when
token ``t`` is allowed. The logits may be wider than the tokenizer (a padded LM head): the
extra ids are never allowed.

The cost is a pass over rows × vocab; on a CPU numpy's ``unpackbits`` does the unpacking (the
int32 words of a little-endian host are their bytes in bit order), about half the time of the
shift-and-mask of a device; on a GPU the mask moves once and is unpacked there.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)
_LITTLE = sys.byteorder == "little"


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed, `rows` rows (CPU int32: where backends write)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def unpack(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """`[rows, words]` int32 → `[rows, width]` bool, True where allowed (on the mask's device)."""
    if bitmask.device.type == "cpu" and _LITTLE:
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits.view(np.bool_))
    else:
        allowed = unpack_by_shifts(bitmask)
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    pad = torch.zeros(bitmask.shape[0], width - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def unpack_by_shifts(bitmask: torch.Tensor) -> torch.Tensor:
    """`[rows, words]` → `[rows, 32 * words]` bool with tensor ops only (any device, any byte order)."""
    shifted = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    return shifted.reshape(bitmask.shape[0], -1).bool()


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: ``logits[rows[i]]`` keeps only the tokens allowed by ``bitmask[i]``."""
    device_mask = bitmask if logits.device.type == "cpu" else bitmask.to(logits.device, non_blocking=True)
    allowed = unpack(device_mask, logits.shape[1])
    if len(rows) == logits.shape[0]:  # every row constrained: no gather and scatter
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
