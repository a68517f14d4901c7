"""Q4_0/Q4_1/Q8_0 weights repacked for the int16-activation path (csrc/cpu/qgemv_packed.h).

Packed once at load, next to the GGUF blocks (which the embedding, `--kernels torch` and the
torch reference keep reading), in panels of 16 weight rows. Q4: per panel and block, 256 bytes of
4-bit values ordered so that one widened 32-byte chunk holds, per 32-bit lane, a pair of
consecutive weights of one row (the operand layout of `vpdpwssd`), then the 16 rows' scales d and
offsets m as fp32 (Q4_1's minimum, Q4_0's −8·d), so every weight is d·q + m. Q8_0 (the LM head):
per panel and block, 512 bytes of int8 weights in the same pair order, then the 16 rows' d.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .formats import Q4_0, Q4_1, Q8_0, BlockFormat

PANEL_ROWS = 16


class Packed(NamedTuple):
    """A packed matrix of N rows, nb blocks a row, P = ceil(N / 16) panels: `qs` uint8
    [P, nb * 256] (Q4) or [P, nb * 512] (Q8_0), `dm` fp32 [P, nb * 32] (Q4: d, m) or [P, nb * 16]
    (Q8_0: d)."""

    qs: torch.Tensor
    dm: torch.Tensor


def packable(fmt: BlockFormat) -> bool:
    """Whether the linear layers of `fmt` pack (the Q4 formats; Q8_0 packs for the LM head)."""
    return fmt in (Q4_0, Q4_1)


def pack(raw: torch.Tensor, fmt: BlockFormat) -> Packed:
    """Repack `raw` (rows of `fmt` blocks) into the layout above."""
    return pack_q8(raw) if fmt is Q8_0 else pack_q4(raw, fmt)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat((t, t.new_zeros(rows, *t.shape[1:]))) if rows else t


def pack_q8(raw: torch.Tensor) -> Packed:
    """Repack `raw` (rows of Q8_0 blocks) for the int16 path (rows past N in the last panel are
    zero)."""
    n = raw.shape[0]
    nb = raw.shape[1] // Q8_0.block_bytes
    blocks = raw.reshape(n, nb, Q8_0.block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    q = blocks[..., 2:]  # [n, nb, 32] int8 bits, weight i of each block
    panels = -(-n // PANEL_ROWS)
    q, d = _pad_rows(q, panels * PANEL_ROWS - n), _pad_rows(d, panels * PANEL_ROWS - n)
    # weight i = 2c + e of row f in panel p goes to chunk c, byte 2f + e
    q5 = q.reshape(panels, PANEL_ROWS, nb, 16, 2).permute(0, 2, 3, 1, 4)  # p, b, c, f, e
    scales = d.view(panels, PANEL_ROWS, nb).permute(0, 2, 1)  # p, b, f
    return Packed(q5.reshape(panels, nb * 512).contiguous(), scales.reshape(panels, nb * PANEL_ROWS).contiguous())


def pack_q4(raw: torch.Tensor, fmt: BlockFormat) -> Packed:
    """Repack `raw` (rows of Q4_0 / Q4_1 blocks) into the layout above (rows past N in the last
    panel are zero: q = 0, d = m = 0)."""
    if not packable(fmt):
        raise ValueError(f"only Q4_0 and Q4_1 pack as Q4, not {fmt.name}")
    n = raw.shape[0]
    nb = raw.shape[1] // fmt.block_bytes
    blocks = raw.reshape(n, nb, fmt.block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    if fmt is Q4_1:
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        qs = blocks[..., 4:]
    else:
        m = -8.0 * d
        qs = blocks[..., 2:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [n, nb, 32]: weight i of each block, natural order
    panels = -(-n // PANEL_ROWS)
    pad = panels * PANEL_ROWS - n
    q, d, m = _pad_rows(q, pad), _pad_rows(d, pad), _pad_rows(m, pad)
    # weight i = 4c + 2h + e of row f in panel p goes to chunk c, byte 2f + e, nibble h (low h = 0)
    q6 = q.view(panels, PANEL_ROWS, nb, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)  # p, b, c, f, e, h
    packed = (q6[..., 0] | (q6[..., 1] << 4)).reshape(panels, nb * 256).contiguous()
    scales = torch.stack((d, m)).view(2, panels, PANEL_ROWS, nb).permute(1, 3, 0, 2)  # p, b, (d|m), f
    return Packed(packed, scales.reshape(panels, nb * 2 * PANEL_ROWS).contiguous())
