"""The KV pool's memory on the CPU: zeros that become resident only as blocks are written."""
from __future__ import annotations

import torch

from pdserve.kvcache import CacheTensorSpec, HostTier, KVPool


def resident_mib() -> dict[str, float]:
    """This process's VmRSS and RssShmem, in MiB."""
    lines = (line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(v.split()[0]) / 1024 for k, v in lines if k in ("VmRSS", "RssShmem")}


def test_a_cpu_pool_reads_zero_and_is_resident_only_where_written():
    """A 512 MiB pool and a 256 MiB host tier add (almost) nothing resident until written; writing
    64 blocks makes those blocks' bytes resident, as shared memory (what the soak's leak check
    leaves out), and no more; every other block still reads zero."""
    specs = [[CacheTensorSpec("k", (2, 64), torch.float32), CacheTensorSpec("v", (2, 64), torch.float32)]] * 4
    written = 64 * KVPool.bytes_per_block(specs, 16) / 2**20          # 4 MiB
    before = resident_mib()
    pool = KVPool(specs, 8192, 16)                                     # 512 MiB
    host = HostTier(pool, 4096)                                        # 256 MiB
    assert resident_mib()["VmRSS"] - before["VmRSS"] < 16
    for t in pool.tensors():
        t[100:164].fill_(1.0)
    after = resident_mib()
    assert written <= after["VmRSS"] - before["VmRSS"] < written + 16
    assert written <= after["RssShmem"] - before["RssShmem"] < written + 1
    for t in pool.tensors():
        assert t[:100].count_nonzero() == 0 and t[164:].count_nonzero() == 0 and bool(t[100:164].eq(1).all())
    assert all(t.count_nonzero() == 0 for t in host.tensors)


def test_without_memfd_the_pool_is_zeroed_up_front(monkeypatch):
    """Where the OS has no memfd_create (not Linux), the pool is ordinary zeroed memory."""
    import os

    monkeypatch.delattr(os, "memfd_create")
    specs = [[CacheTensorSpec("k", (2, 64), torch.float32)]]
    pool = KVPool(specs, 1024, 16)                                     # 8 MiB
    assert all(t.count_nonzero() == 0 for t in pool.tensors())
    before = resident_mib()
    for t in pool.tensors():
        t.fill_(1.0)
    assert resident_mib()["RssShmem"] - before["RssShmem"] < 1      # not the shared-memory file
