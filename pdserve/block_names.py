"""Block identity for the prefix cache: a chained hash of each full block's token ids.

Block i of a sequence is named by `H(name of block i-1, token ids of block i)`, with the
chain started by a salt that names everything else that shapes the KV (the model, its
dtype, the index-key dtype, the block size). Two sequences share a block's name exactly when
they share every token up to the block's end, under the same salt, so one dictionary lookup
per block finds the longest cached prefix. The hash is blake2b over the ids' bytes, not
Python's `hash()`: it must give the same names in every process of a TP group, and in the
router, which computes a worker's names to ask it what it holds (docs/prefix-cache.md,
"Several routers"). No torch here: the router imports this module.
"""
from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes
NAME_BYTES = 16  # a block name's length (blake2b's digest size here)


def salt_of(*parts: object) -> BlockHash:
    """The chain's start: a digest of whatever besides the tokens changes the cached KV."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=NAME_BYTES).digest()


def request_salt(worker_salt: BlockHash, cache_salt: str | None) -> BlockHash:
    """Where a request's chain starts on a worker: the worker's salt, or, for a request with a
    `cache_salt`, a digest of both (it shares blocks only with that salt's requests)."""
    return worker_salt if cache_salt is None else salt_of(worker_salt, cache_salt)


def extend_hashes(hashes: list[BlockHash], tokens: list[int], block_size: int,
                  salt: BlockHash) -> list[BlockHash]:
    """Append the names of the full blocks of `tokens` not yet in `hashes` (in place); return it.

    `hashes` must name a prefix of `tokens`' blocks (the caller keeps one list per sequence
    and extends it as the sequence grows)."""
    prev = hashes[-1] if hashes else salt
    for i in range(len(hashes), len(tokens) // block_size):
        block = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=NAME_BYTES).digest()
        hashes.append(prev)
    return hashes


def block_hashes(tokens: list[int], block_size: int, salt: BlockHash) -> list[BlockHash]:
    """The names of every full block of `tokens`."""
    return extend_hashes([], tokens, block_size, salt)
