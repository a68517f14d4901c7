"""Transfer tests: NIXL over UCX on loopback only, and a connected pair of agent processes."""
from __future__ import annotations

import os
from typing import Iterator

import pytest

from .harness import Agent, PoolSpec, kind

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before any agent or child process

SPEC = PoolSpec(num_tensors=6, num_blocks=64, block_shape=(16, 2, 64), dtype="float16")
SOURCE_SEED = 1234


@pytest.fixture(scope="session")
def procs() -> Iterator[tuple[Agent, Agent]]:
    """A decode-side target and a prefill-side source in their own processes, connected."""
    target = Agent("target", "pdserve-decode-e2e-tp0", SPEC)
    source = Agent("source", "pdserve-prefill-e2e-tp0", SPEC, seed=SOURCE_SEED)
    try:
        target.ready()
        source.ready()
        assert source.call("connect", target.info) == target.name
        target.wait_for(kind("PeerConnected"))
        yield target, source
    finally:
        target.stop()
        source.stop()
