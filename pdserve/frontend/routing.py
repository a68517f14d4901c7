"""Cache-aware routing: a request goes to the worker most likely to hold its prompt's prefix in
its KV cache, unless that worker is much busier than another one (docs/prefix-cache.md).

The router keeps, per worker, an approximate index of what it sent there: the chained hashes
of the full blocks of each prompt (the workers name their cached blocks the same way, chained,
so block i's hash stands for the whole prefix up to it). The index is an LRU bounded by the
worker's KV pool (`Info.num_blocks`), so it forgets roughly what the worker's own LRU evicts,
and its memory is bounded. A wrong guess costs a cache miss, never a wrong answer.

What other routers sent to a worker (several replicas behind one Service), or what this router
sent before it restarted, is in no index here. So before a request is routed, the workers of
each role that has two or more are asked what they hold of its prompt (`ask`: POST
/cached_prefix with the prompt's block names as that worker names them); a worker's match is
the larger of its index's and its answer.

One request's choice (SGLang's cache-aware router is the model; the rule in our words):

* among the workers that may take it, the one whose index matches the most leading blocks of
  the prompt (ties: the least loaded) — reason ``prefix``;
* unless that worker is overloaded against the least-loaded one: its load exceeds the least
  load by more than ``balance_abs`` requests *and* by a factor of ``balance_rel`` — then the
  least loaded (reason ``balance``); the prefix is sent there too, so a hot prefix spreads;
* no worker matches a block: the least loaded (reason ``load``).

Every role caches prefixes, so every choice is made this way: a prefill or colocated worker
computes only what it lacks; a PD decode worker keeps the KV it received and computed, and asks
the prefill worker only for the blocks it lacks (docs/prefix-cache.md). A PD request makes two
decisions, one per worker.

``Placement`` holds one request's choices until its routes are reserved; only then are its
blocks entered into the index and its decisions counted (admission may try a request many
times while it waits for room).
"""
from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from pdserve.block_names import block_hashes as worker_block_names, request_salt
from pdserve.frontend.worker_client import WorkerClient
from pdserve.frontend.workers import Route, WorkerEndpoint, least_loaded
from pdserve.worker_api import Info, Role

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16          # a worker that has not reported its block size yet
MAX_BLOCKS_PER_WORKER = 1 << 16  # the index's bound per worker, whatever its pool reports
BALANCE_ABS = 2                  # requests: a prefix holder this much busier than the least loaded ...
BALANCE_REL = 1.5                # ... and this many times as busy is passed over
ASK_TIMEOUT_S = 0.1              # a worker that answers /cached_prefix later is routed by the index alone


class Policy(str, enum.Enum):
    """`--routing`."""

    CACHE_AWARE = "cache-aware"
    LEAST_LOADED = "least-loaded"


class Reason(str, enum.Enum):
    """Why a worker was chosen (the metrics' label)."""

    PREFIX = "prefix"    # it most likely holds the longest prefix of the prompt
    BALANCE = "balance"  # a prefix holder was too busy: the least loaded instead
    LOAD = "load"        # nothing of the prompt is cached anywhere (or least-loaded routing)


REASONS = tuple(r.value for r in Reason)


class Decision(NamedTuple):
    worker: WorkerEndpoint
    reason: Reason
    matched_blocks: int


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The chained hash of every full block of `token_ids`: hash(i) = H(hash(i-1) ‖ block i),
    started by the request's `cache_salt` as the workers' chains are (a salted prompt matches
    only what was sent with the same salt). 64 bits: a collision only misroutes one request."""
    out: list[int] = []
    prev = b"" if cache_salt is None else hashlib.blake2b(cache_salt.encode(), digest_size=8).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(prev + array("I", token_ids[start:start + block_size]).tobytes(),
                                 digest_size=8).digest()
        out.append(int.from_bytes(digest, "little"))
        prev = digest
    return out


class PromptKey:
    """A prompt's token ids (and its request's cache salt), hashed per block size on first use;
    `asked`: the workers asked what they hold of it, and `reported`: the leading blocks each of
    them said it holds, where it answered in time (`CacheAwareRouter.ask`)."""

    def __init__(self, token_ids: Sequence[int], cache_salt: str | None = None) -> None:
        self.token_ids = token_ids
        self.cache_salt = cache_salt
        self._hashes: dict[int, list[int]] = {}
        self.asked: set[WorkerEndpoint] = set()
        self.reported: dict[WorkerEndpoint, int] = {}

    def hashes(self, block_size: int) -> list[int]:
        if block_size not in self._hashes:
            self._hashes[block_size] = block_hashes(self.token_ids, block_size, self.cache_salt)
        return self._hashes[block_size]


class PrefixIndex:
    """The block hashes one worker was sent, least recently sent first, at most `capacity`."""

    def __init__(self, capacity: int, info: Info | None = None) -> None:
        self.capacity = max(1, capacity)
        self.info = info  # the worker's /info when it was made: a new one means a new process
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt are here."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class CacheAwareRouter:
    """The routing policy over the pool's workers; `placement(prompt_ids)` is the entry point."""

    def __init__(self, policy: Policy = Policy.CACHE_AWARE, *, balance_abs: int = BALANCE_ABS,
                 balance_rel: float = BALANCE_REL, max_blocks_per_worker: int = MAX_BLOCKS_PER_WORKER,
                 local_prefill_tokens: int = 0) -> None:
        self.policy = Policy(policy)
        self.local_prefill_tokens = local_prefill_tokens
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_blocks_per_worker = max_blocks_per_worker
        self.decisions: dict[Reason, int] = {r: 0 for r in Reason}
        self.on_decision: Callable[[str], None] | None = None  # metrics
        self.on_ask: Callable[[bool], None] | None = None      # metrics: one call per worker asked (answered?)
        self.on_local: Callable[[], None] | None = None        # metrics: a PD request sent to its decode worker alone
        self._index: dict[WorkerEndpoint, PrefixIndex] = {}

    def placement(self, key: PromptKey | None) -> Placement:
        """The choices of one request for the prompt `key` (None: no prompt known: least
        loaded). Admission makes one per attempt to find room, with the request's one key."""
        return Placement(self, key)

    def retain(self, workers: Iterable[WorkerEndpoint]) -> None:
        """Forget the workers that left, and those that are no longer the process they were
        (out of rotation, or back with a new /info): their caches are gone."""
        live = {w for w in workers if w.healthy and not w.retired}
        for w in [w for w, idx in self._index.items() if w not in live or w.info is not idx.info]:
            del self._index[w]

    def forget(self) -> None:
        """The workers forgot their caches (a reset): so does the index."""
        self._index.clear()

    def index(self, w: WorkerEndpoint) -> PrefixIndex:
        idx = self._index.get(w)
        if idx is None or idx.info is not w.info:
            pool = w.info.num_blocks if w.info is not None and w.info.num_blocks > 0 else self.max_blocks_per_worker
            idx = self._index[w] = PrefixIndex(min(pool, self.max_blocks_per_worker), w.info)
        return idx

    async def ask(self, client: WorkerClient, workers: Iterable[WorkerEndpoint], key: PromptKey) -> None:
        """Fill `key.reported`: ask the available workers what leading blocks of the prompt
        they hold (in the device pool or the host tier), where an answer could change a choice:
        cache-aware routing, a role with two workers or more (or, with `local_prefill_tokens`, a
        decode worker: `Placement.local` goes by its answer), a worker with a prefix cache. The
        names are computed once per distinct chain (salt and block size), off the event loop;
        the workers are asked at once, and those that do not answer within `ASK_TIMEOUT_S`
        count only by the index. An answer carries the worker's load too, which replaces the
        last poll's: with several routers, what the others sent since counts."""
        if self.policy is not Policy.CACHE_AWARE:
            return
        by_role: dict[Role, list[WorkerEndpoint]] = {}
        for w in workers:
            if w.available and w.info is not None and w.info.prefix_salt:
                by_role.setdefault(w.role, []).append(w)
        # each worker's chain, read now: a worker's /info is dropped when it leaves the rotation
        chain_of = {w: (w.info.prefix_salt, _block_size(w)) for role, ws in by_role.items()
                    if len(ws) > 1 or (role is Role.DECODE and self.local_prefill_tokens) for w in ws}
        chains = set(chain_of.values())
        if not chains or len(key.token_ids) < min(bs for _, bs in chains):
            return

        def names() -> dict[tuple[str, int], str]:
            return {(salt, bs): b"".join(worker_block_names(key.token_ids, bs,
                                                             request_salt(bytes.fromhex(salt), key.cache_salt))).hex()
                    for salt, bs in chains}

        chain_names = await asyncio.to_thread(names)
        asked = list(chain_of)
        key.asked.update(asked)
        answers = await asyncio.gather(*(client.cached_prefix(w.url, chain_names[chain_of[w]], ASK_TIMEOUT_S)
                                         for w in asked))
        for w, answer in zip(asked, answers):
            if answer is not None:
                key.reported[w] = answer.device_blocks + answer.host_blocks
                w.load = answer.load  # fresher than the last poll: other routers' requests count
            if self.on_ask is not None:
                self.on_ask(answer is not None)

    def decide(self, workers: Sequence[WorkerEndpoint], key: PromptKey | None) -> Decision | None:
        """The worker for one choice among `workers` (pure: nothing is recorded)."""
        least = least_loaded(list(workers))
        if least is None:
            return None
        if self.policy is Policy.LEAST_LOADED or key is None:
            return Decision(least, Reason.LOAD, 0)
        best, matched = least, 0
        for w in sorted(workers, key=_load_order):  # ties: the least loaded first
            n = self.index(w).match(key.hashes(_block_size(w))) if w in self._index else 0
            n = max(n, key.reported.get(w, 0))
            if n > matched:
                best, matched = w, n
        if matched == 0:
            return Decision(least, Reason.LOAD, 0)
        if self.overloaded(best, least):
            logger.debug("routing: %s holds %d block(s) of the prompt but has load %d; %s (load %d) instead",
                         best.url, matched, best.score(), least.url, least.score())
            return Decision(least, Reason.BALANCE, 0)
        return Decision(best, Reason.PREFIX, matched)

    def overloaded(self, holder: WorkerEndpoint, least: WorkerEndpoint) -> bool:
        busy, idle = holder.score(), least.score()
        return busy - idle > self.balance_abs and busy > self.balance_rel * idle

    def record(self, decision: Decision, key: PromptKey | None) -> None:
        """The request was sent: its prompt's blocks are now (likely) cached on the worker."""
        self.decisions[decision.reason] += 1
        if self.on_decision is not None:
            self.on_decision(decision.reason.value)
        if key is not None and self.policy is Policy.CACHE_AWARE:
            self.index(decision.worker).insert(key.hashes(_block_size(decision.worker)))


class Placement:
    """One request's worker choices (`choose`, given to `WorkerPool.pick`), kept until
    `commit` records them once its routes are reserved."""

    def __init__(self, router: CacheAwareRouter, key: PromptKey | None) -> None:
        self.router = router
        self.key = key
        self.decisions: list[Decision] = []

    def choose(self, workers: list[WorkerEndpoint]) -> WorkerEndpoint | None:
        decision = self.router.decide(workers, self.key)
        if decision is None:
            return None
        self.decisions.append(decision)
        return decision.worker

    def local(self, w: WorkerEndpoint) -> bool:
        """Whether the decode worker `w`, just chosen, computes the prompt itself: it holds all but
        at most `local_prefill_tokens` of it. Sending the rest through a prefill worker would cost
        a hop, a transfer and, there, a recompute of what only the decode worker computed (the
        previous answer of a conversation). A wrong yes costs more (the whole prompt computed
        among the decode worker's streams), so what the worker said it holds decides, not the
        router's record, which counts a prompt as held as soon as it was sent; a worker asked that
        did not answer in time holds nothing here. Only with `--no-ask-caches` does the record
        decide."""
        limit = self.router.local_prefill_tokens
        if not limit or self.key is None or w.role is not Role.DECODE:
            return False
        if w in self.key.asked:
            matched = self.key.reported.get(w, 0)
        elif w.info is not None and w.info.prefix_salt:  # not asked: the record's estimate
            matched = max((d.matched_blocks for d in self.decisions if d.worker is w), default=0)
        else:  # no prefix cache: it holds nothing, whatever it was sent
            matched = 0
        return len(self.key.token_ids) - matched * _block_size(w) <= limit

    def discard(self) -> None:
        """The choices made so far were not used (no room for all of them)."""
        self.decisions.clear()

    def commit(self, routes: Iterable[Route]) -> None:
        """The request's routes are reserved: record the choices they use."""
        routes = list(routes)
        used = {w for route in routes for w in route if w is not None}
        if self.router.on_local is not None:
            for route in routes:
                if route.prefill is None and route.decode.role is Role.DECODE:
                    self.router.on_local()
        for decision in self.decisions:
            if decision.worker in used:
                self.router.record(decision, self.key)
        self.decisions.clear()


def _block_size(w: WorkerEndpoint) -> int:
    return w.info.block_size if w.info is not None and w.info.block_size > 0 else DEFAULT_BLOCK_SIZE


def _load_order(w: WorkerEndpoint) -> tuple[int, float]:
    return (w.score(), w.last_pick)
