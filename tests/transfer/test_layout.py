"""Pool layouts, descriptor indices, layout checks, bootstrap info and agent names."""
from __future__ import annotations

import pytest
import torch

from pdserve.transfer.bootstrap import BootstrapInfo, agent_name
from pdserve.transfer.layout import LayoutMismatch, PoolLayout

pytestmark = pytest.mark.timeout(60)


def pool(num_tensors: int = 3, num_blocks: int = 8, block=(4, 16)) -> list[torch.Tensor]:
    return [torch.zeros(num_blocks, *block, dtype=torch.float16) for _ in range(num_tensors)]


def test_layout_of_a_pool() -> None:
    p = pool()
    lay = PoolLayout.of(p)
    assert lay.mem_type == "DRAM" and len(lay.regions) == 3
    assert lay.regions[1].base == p[1].data_ptr()
    assert lay.regions[1].block_bytes == 4 * 16 * 2 and lay.regions[1].num_blocks == 8


def test_descriptors_address_every_block_tensor_major() -> None:
    p = pool(num_tensors=2, num_blocks=4)
    d = PoolLayout.of(p).descriptors()
    assert d.shape == (8, 3)
    assert int(d[5, 0]) == p[1][1].data_ptr() and int(d[5, 1]) == p[1][1].nbytes
    assert PoolLayout.of(p).indices([3, 1]).tolist() == [3, 1, 7, 5]


def test_peers_may_differ_in_block_count_only() -> None:
    ours = PoolLayout.of(pool(num_blocks=8))
    ours.check_compatible(PoolLayout.of(pool(num_blocks=32)), "peer")
    with pytest.raises(LayoutMismatch, match="3 pool tensors here, 4 there"):
        ours.check_compatible(PoolLayout.of(pool(num_tensors=4)), "peer")
    with pytest.raises(LayoutMismatch, match="tensor 0 has 128 bytes per block here, 256"):
        ours.check_compatible(PoolLayout.of(pool(block=(8, 16))), "peer")


def test_non_contiguous_or_mixed_pools_are_refused() -> None:
    with pytest.raises(ValueError):
        PoolLayout.of([torch.zeros(8, 4).t()])
    with pytest.raises(ValueError):
        PoolLayout.of([])


def test_block_ranges() -> None:
    lay = PoolLayout.of(pool(num_blocks=8))
    assert lay.blocks_valid([0, 7]) and not lay.blocks_valid([8]) and not lay.blocks_valid([-1])


def test_bootstrap_info_round_trips() -> None:
    info = BootstrapInfo("pdserve-decode-d0-tp1", "abcd", b"\x00md\xff", PoolLayout.of(pool()))
    assert BootstrapInfo.from_bytes(info.to_bytes()) == info
    with pytest.raises(ValueError, match="malformed"):
        BootstrapInfo.from_bytes(b"{}")
    with pytest.raises(ValueError, match="malformed"):
        BootstrapInfo.from_bytes(b"\xff")


def test_agent_names_carry_worker_and_rank() -> None:
    assert agent_name("prefill", "p0", 3) == "pdserve-prefill-p0-tp3"
    with pytest.raises(ValueError):
        agent_name("decode", "bad id", 0)
