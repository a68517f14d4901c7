"""Eviction under PD transfer, in one process: a prefill engine (prefix cache on, a small pool)
serves requests sharing prefixes while a slow transfer link "reads" each room's blocks for a
random number of steps, and aborts land at random moments. Every room's blocks hold, when its
transfer ends (written or fenced), exactly the bytes they held when it started: no block a
transfer reads is evicted or handed to another request before its room's last word. The first
tokens equal those of the same engine with the cache off."""
from __future__ import annotations

import random

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import FinishReason, KVRole
from pdserve.scheduler.plan import TransferKind, TransferOutcome

BS = 4


class SlowReads:
    """A prefill rank's transfer link whose writes take a few steps, checking what they read."""

    def __init__(self, engine: LLMEngine, seed: int):
        self.engine, self.rng = engine, random.Random(seed)
        self.rooms: dict[str, tuple[list[int], list[torch.Tensor], int, bool]] = {}
        self.max_open = 0
        self.checked = 0

    def _read(self, blocks: list[int]) -> list[torch.Tensor]:
        return [t[blocks].clone() for t in self.engine.pool.tensors()]

    def act(self, plan, outputs, held) -> None:
        for rid, _ in plan.aborted:
            if rid in self.rooms:  # the write stops; a fence follows once nothing reads any more
                blocks, snap, left, _ = self.rooms[rid]
                self.rooms[rid] = (blocks, snap, left, True)
        for out in outputs:
            if out.finish_reason is FinishReason.KV_PENDING:
                blocks = list(held[out.request_id].block_table)
                self.rooms[out.request_id] = (blocks, self._read(blocks), self.rng.randint(1, 8), False)
        self.max_open = max(self.max_open, len(self.rooms))

    def observe(self) -> list[TransferOutcome]:
        out = []
        for rid, (blocks, snap, left, aborted) in list(self.rooms.items()):
            if left > 0:
                self.rooms[rid] = (blocks, snap, left - 1, aborted)
                continue
            now = self._read(blocks)  # the transfer's last read: the blocks must be untouched
            assert all(torch.equal(a, b) for a, b in zip(snap, now)), f"room {rid}: its blocks changed"
            self.checked += 1
            del self.rooms[rid]
            out.append(TransferOutcome(rid, TransferKind.FENCED if aborted else TransferKind.WRITTEN))
        return out


def engine(model_dir: str, cache: bool, blocks: int) -> LLMEngine:
    per_block = BS * 2 * 2 * 2 * 16 * 4  # tiny_llama: layers × (K, V) × KV heads × dims × fp32
    return LLMEngine(EngineConfig(model=model_dir, block_size=BS, kv_cache_memory=blocks * per_block,
                                  max_num_batched_tokens=48, max_num_seqs=8, prefix_cache=cache),
                     kv_role=KVRole.PREFILL)


def run(e: LLMEngine, prompts: list[list[int]], aborts: bool, seed: int) -> tuple[dict[str, int], SlowReads]:
    link = SlowReads(e, seed)
    e.attach_link(link)
    rng = random.Random(seed)
    first: dict[str, int] = {}
    pending = list(enumerate(prompts))
    while pending or e.has_work() or link.rooms:
        for _ in range(rng.randint(0, 3)):  # arrivals spread over the run
            if pending:
                i, p = pending.pop(0)
                e.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=4))
        if aborts and rng.random() < 0.15 and e.scheduler.held:
            e.abort(rng.choice(sorted(e.scheduler.held)))
        _, outputs = e.step()
        for o in outputs:
            if o.finish_reason is FinishReason.KV_PENDING:
                first[o.request_id] = o.token_id
        e.allocator.check_integrity()
        holders = [b for s in [*e.scheduler.seqs.values(), *e.scheduler.held.values()] for b in s.block_table]
        assert all(e.allocator.refcount(b) == holders.count(b) for b in set(holders))
    return first, link


def test_eviction_while_rooms_transfer_keeps_their_blocks(tiny_llama_dir):
    rng = random.Random(3)
    systems = [[rng.randrange(3, 300) for _ in range(22)] for _ in range(3)]
    prompts = [systems[i % 3] + [rng.randrange(3, 300) for _ in range(rng.randint(1, 14))] for i in range(40)]
    on = engine(tiny_llama_dir, True, 40)
    first, link = run(on, prompts, aborts=True, seed=1)
    assert on.allocator.num_evictions > 0 and on.allocator.num_hits > 0  # pressure, and reuse
    assert link.max_open >= 3 and link.checked >= len(first)
    assert on.allocator.num_used == 0 and on.allocator.num_free == on.pool.num_blocks
    off = engine(tiny_llama_dir, False, 40)
    ref, _ = run(off, prompts, aborts=False, seed=1)
    for rid, token in first.items():
        assert token == ref[rid], rid
