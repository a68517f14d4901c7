"""What a worker counts: its requests' metrics, its aborts by origin, its transfer agent's
counters. Fed by the loop thread (outputs, snapshots) and the API (starts, aborts)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from pdserve.engine.sequence import FinishReason
from pdserve.logs import about
from pdserve.metrics import WorkerMetrics
from pdserve.scheduler.plan import StepOutput

from .aborts import AbortLedger

logger = logging.getLogger(__name__)

_ROOM_ENDS = ("done", "failed", "aborted")


@dataclass
class _RequestStats:
    arrival: float
    prompt_tokens: int
    generated: int = 0
    write_at: float | None = None  # prefill: when its KV write started
    blocks_kept: int = 0  # prefill: the prompt's leading blocks the decode worker holds (not sent)


class Accounting:
    """One worker's metrics. `kv_bytes_per_block`: KV bytes of one block over all TP ranks."""

    def __init__(self, role: str, model_name: str, kv_bytes_per_block: int, block_size: int):
        self.metrics = WorkerMetrics(role, model_name)
        self.aborts = AbortLedger(self.metrics.aborted)
        self.kv_bytes_per_block, self.block_size = kv_bytes_per_block, block_size
        self._stats: dict[str, _RequestStats] = {}
        self._lock = threading.Lock()
        self._agent_counts: dict[str, int] = {}
        self.transfer: dict[str, int] = {}  # the agent's counters, as of the last snapshot

    def started(self, rid: str, prompt_tokens: int, blocks_kept: int = 0) -> None:
        with self._lock:
            self._stats[rid] = _RequestStats(time.monotonic(), prompt_tokens, blocks_kept=blocks_kept)
        self.aborts.started(rid)

    def step(self, step_s: float, agree_s: float) -> None:
        self.metrics.scheduler_step(step_s, agree_s)
        self.aborts.sweep()

    def load(self, scheduler) -> None:
        a = scheduler.allocator
        running, waiting = scheduler.load()
        self.metrics.set_load(running=running, waiting=waiting + len(scheduler.held),
                              used_blocks=a.num_used, total_blocks=a.num_blocks)
        host = a.host
        self.metrics.cache_tiers(device_cached=a.num_cached, host_used=host.num_cached if host else 0,
                                 host_total=host.num_blocks if host else 0)
        self.metrics.scheduler_counts(cache_queries=a.num_queries, cache_hits=a.num_hits,
                                      preemptions=scheduler.num_preemptions, host_hits=a.num_host_hits,
                                      evictions=a.num_evictions, host_drops=host.num_dropped if host else 0,
                                      forgotten=a.num_forgotten)

    def agent(self, counts: dict[str, int]) -> None:
        """The agent's cumulative counters → metric increments since the last call."""
        self.transfer = counts
        late = sum(v for k, v in counts.items() if k.startswith(("late_", "unknown_")))
        for state in _ROOM_ENDS:
            for _ in range(self._delta(f"rooms_{state}", counts.get(f"rooms_{state}", 0))):
                self.metrics.room_ended(state)
        self.metrics.late_messages_dropped.inc(self._delta("late", late))
        self.metrics.kv_rooms_failed_peer_dead.inc(
            self._delta("peer_dead", counts.get("peer_dead_failed_rooms", 0)))
        self.metrics.transfer_gauges(rooms_live=counts.get("rooms_live", 0),
                                     writes_in_flight=counts.get("writes_in_flight", 0))

    def _delta(self, key: str, value: int) -> int:
        n = value - self._agent_counts.get(key, 0)
        self._agent_counts[key] = value
        return max(n, 0)

    def outputs(self, outputs: list[StepOutput], now: float) -> None:
        for out in outputs:
            st = self._stats.get(out.request_id)
            if st is None:
                continue
            if out.token_id is not None:
                st.generated += 1
            if out.finish_reason is FinishReason.KV_PENDING:  # prefill: the KV write starts now
                st.write_at = now
                continue
            if out.finish_reason is FinishReason.PREFILLED and st.write_at is not None:
                blocks = -(-st.prompt_tokens // self.block_size) - st.blocks_kept  # the blocks written
                self.metrics.kv_transferred(now - st.write_at, blocks * self.kv_bytes_per_block)
            if out.finish_reason:
                self._finished(out, st, now)

    def _finished(self, out: StepOutput, st: _RequestStats, now: float) -> None:
        with self._lock:
            del self._stats[out.request_id]
        self.aborts.finished(out.request_id)
        if out.finish_reason is FinishReason.ERROR:
            logger.warning("request %s failed: %s", out.request_id, out.error, extra=about(out.request_id))
        else:
            logger.debug("request %s finished (%s) after %d tokens", out.request_id, out.finish_reason,
                         st.generated, extra=about(out.request_id))
        # a prefill worker's request ends when its first token (its whole output) is handed over
        reason = FinishReason.LENGTH if out.finish_reason is FinishReason.PREFILLED else out.finish_reason
        self.metrics.request_finished(str(reason), prompt_tokens=st.prompt_tokens,
                                      generation_tokens=st.generated, decode_s=now - st.arrival)
