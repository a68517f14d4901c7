"""The SM120 scale-factor layout: the spec's offset formula, padding, inverse."""
from __future__ import annotations

import pytest
import torch

from pdserve_kernels.nvfp4 import swizzle_offset, swizzle_scales, swizzled_size, unswizzle_scales


def _spec_offset(r: int, k: int, k_blocks: int) -> int:
    """offset(r, k) from docs/nvfp4.md, written out independently."""
    return ((r // 128) * -(-k_blocks // 4) + k // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + k % 4


@pytest.mark.parametrize("rows,k_blocks", [(200, 96), (130, 256), (130, 6), (1, 1), (128, 4)])
def test_swizzle_places_every_scale_at_the_spec_offset(rows: int, k_blocks: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + k_blocks)
    sf = torch.randint(1, 256, (rows, k_blocks), dtype=torch.uint8, generator=g)
    buf = swizzle_scales(sf)
    assert buf.numel() == swizzled_size(rows, k_blocks)
    assert buf.numel() == -(-rows // 128) * 128 * -(-k_blocks // 4) * 4
    r = torch.arange(rows).repeat_interleave(k_blocks)
    k = torch.arange(k_blocks).repeat(rows)
    offsets = torch.tensor([_spec_offset(a, b, k_blocks) for a, b in zip(r.tolist(), k.tolist())])
    assert torch.equal(buf[offsets], sf.flatten())
    assert all(swizzle_offset(a, b, k_blocks) == o for a, b, o in
               zip(r.tolist()[::97], k.tolist()[::97], offsets.tolist()[::97]))
    padding = torch.ones(buf.numel(), dtype=torch.bool)
    padding[offsets] = False
    assert (buf[padding] == 0).all()  # padding is zero, never NaN (0x7f) for the MMA


@pytest.mark.parametrize("rows,k_blocks", [(200, 96), (130, 256), (3, 2)])
def test_unswizzle_inverts_swizzle(rows: int, k_blocks: int) -> None:
    sf = torch.rand(rows, k_blocks).mul(400).to(torch.float8_e4m3fn)
    buf = swizzle_scales(sf)
    assert buf.dtype == torch.float8_e4m3fn
    assert torch.equal(unswizzle_scales(buf, rows, k_blocks).view(torch.uint8), sf.view(torch.uint8))


def test_unswizzle_rejects_a_wrong_size() -> None:
    with pytest.raises(ValueError):
        unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 128, 4)
