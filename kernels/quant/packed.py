"""Q4_0/Q4_1 weights repacked for the int16-activation path (csrc/cpu/qgemv_packed.h).

Packed once at load, next to the GGUF blocks (which the embedding, `--kernels torch` and the
torch reference keep reading), in panels of 16 weight rows: per panel and block, 256 bytes of
4-bit values ordered so that one widened 32-byte chunk holds, per 32-bit lane, a pair of
consecutive weights of one row (the operand layout of `vpdpwssd`), then the 16 rows' scales d and
offsets m as fp32 (Q4_1's minimum, Q4_0's −8·d), so every weight is d·q + m.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .formats import BLOCK, Q4_0, Q4_1, BlockFormat

PANEL_ROWS = 16


class PackedQ4(NamedTuple):
    """A packed matrix of N rows, nb blocks a row, P = ceil(N / 16) panels: `qs` uint8
    [P, nb * 256], `dm` fp32 [P, nb * 32]."""

    qs: torch.Tensor
    dm: torch.Tensor


def packable(fmt: BlockFormat) -> bool:
    return fmt in (Q4_0, Q4_1)


def pack_q4(raw: torch.Tensor, fmt: BlockFormat) -> PackedQ4:
    """Repack `raw` (rows of Q4_0 / Q4_1 blocks) into the layout above (rows past N in the last
    panel are zero: q = 0, d = m = 0)."""
    if not packable(fmt):
        raise ValueError(f"only Q4_0 and Q4_1 pack for the int16 path, not {fmt.name}")
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
    if pad:
        q = torch.cat((q, q.new_zeros(pad, nb, BLOCK)))
        d = torch.cat((d, d.new_zeros(pad, nb)))
        m = torch.cat((m, m.new_zeros(pad, nb)))
    # weight i = 4c + 2h + e of row f in panel p goes to chunk c, byte 2f + e, nibble h (low h = 0)
    q6 = q.view(panels, PANEL_ROWS, nb, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)  # p, b, c, f, e, h
    packed = (q6[..., 0] | (q6[..., 1] << 4)).reshape(panels, nb * 256).contiguous()
    scales = torch.stack((d, m)).view(2, panels, PANEL_ROWS, nb).permute(1, 3, 0, 2)  # p, b, (d|m), f
    return PackedQ4(packed, scales.reshape(panels, nb * 2 * PANEL_ROWS).contiguous())
