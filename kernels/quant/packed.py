"""Q4_0/Q4_1 weights repacked for the int16-activation decode path (csrc/cpu/qgemv_packed.h).

Packed once at load, next to the GGUF blocks (which prefill, the embedding and the torch
reference keep reading): per row, two blocks share 32 bytes (block 2p's 4-bit values in the low
nibbles, block 2p+1's in the high ones, each in natural order), and the scales are fp32:
`dm[:, :nbp]` the block scales d, `dm[:, nbp:]` the offsets m (Q4_1's minimum, Q4_0's −8·d), so
every weight is d·q + m. One 32-byte load then feeds 64 weights to the integer dot products.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .formats import BLOCK, Q4_0, Q4_1, BlockFormat


class PackedQ4(NamedTuple):
    """A packed matrix: `qs` uint8 [N, nbp * 16], `dm` fp32 [N, 2 * nbp] (nbp: blocks, even)."""

    qs: torch.Tensor
    dm: torch.Tensor


def packable(fmt: BlockFormat) -> bool:
    return fmt in (Q4_0, Q4_1)


def pack_q4(raw: torch.Tensor, fmt: BlockFormat) -> PackedQ4:
    """Repack `raw` (rows of Q4_0 / Q4_1 blocks) into the layout above (an odd block count gets a
    zero block: q = 0, d = m = 0)."""
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
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [n, nb, 32]: weight j of each block, natural order
    nbp = nb + nb % 2
    if nbp != nb:
        q = torch.cat((q, q.new_zeros(n, 1, BLOCK)), dim=1)
        d = torch.cat((d, d.new_zeros(n, 1)), dim=1)
        m = torch.cat((m, m.new_zeros(n, 1)), dim=1)
    pairs = q.view(n, nbp // 2, 2, BLOCK)
    packed = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, nbp * BLOCK // 2).contiguous()
    return PackedQ4(packed, torch.cat((d, m), dim=1).contiguous())
