"""Packed bitmasks against a per-token reference: bit t%32 of word t//32 allows token t."""
from __future__ import annotations

import torch

from pdserve.structured.bitmask import apply_bitmask, new_bitmask, unpack, unpack_by_shifts


def reference_allowed(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(bitmask.shape[0], width, dtype=torch.bool)
    for r in range(bitmask.shape[0]):
        for t in range(min(width, 32 * bitmask.shape[1])):
            out[r, t] = bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1)
    return out


def test_unpack_matches_the_per_token_reference_including_bit_31_and_padding() -> None:
    g = torch.Generator().manual_seed(0)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    mask[0, 0] = -(2**31)  # only bit 31 set
    for width in (100, 128, 150):  # narrower than, as wide as, wider than the mask (padded LM head)
        assert torch.equal(unpack(mask, width), reference_allowed(mask, width))
    assert torch.equal(unpack_by_shifts(mask), reference_allowed(mask, 128))  # the device path


def test_apply_bitmask_to_every_row() -> None:
    logits = torch.randn(2, 40)
    mask = new_bitmask(2, 40)
    mask[:, 1] = 0  # tokens 32..39 disallowed in both rows
    expected = logits.clone()
    expected[:, 32:] = float("-inf")
    apply_bitmask(logits, [0, 1], mask)
    assert torch.equal(logits, expected)


def test_apply_bitmask_sets_exactly_the_disallowed_logits_of_the_given_rows() -> None:
    logits = torch.randn(4, 70)
    before = logits.clone()
    mask = new_bitmask(2, 64)  # the tokenizer knows 64 tokens; ids 64..69 are never allowed
    mask[0] = 0
    mask[0, 0] = 0b1010        # row 1 of the logits: tokens 1 and 3
    mask[1, 1] = 0             # row 3: tokens 0..31 only
    apply_bitmask(logits, [1, 3], mask)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed1 = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed1 == [1, 3] and torch.equal(logits[1, [1, 3]], before[1, [1, 3]])
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == list(range(32))
