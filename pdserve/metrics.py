"""Prometheus metrics of the router and the workers, in the `pdserve:` namespace.

Names, units and label names follow vLLM's (`vllm:` becomes `pdserve:`), so dashboards and
alerts written for vLLM carry over. Every series carries `model_name` and `role`
(router | prefill | decode | both), so the router's and the workers' series never mix in a sum.

Each process owns one `WorkerMetrics` or `RouterMetrics`; each owns its own
`CollectorRegistry` (no module-level metrics), so two instances in one process (tests, the
embedded `pdserve serve`) never collide. `render()` is the body of GET /metrics.

Label values that come from code (finish reasons, room states, abort origins) are a fixed
set; anything else is counted under "other" so a bug can never explode the series count.
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

NAMESPACE = "pdserve"
CONTENT_TYPE = CONTENT_TYPE_LATEST

FINISH_REASONS = ("stop", "length", "tool_calls", "abort", "error")
ROOM_STATES = ("done", "failed", "aborted")
# client: the HTTP client went away; router: the router cancelled (stop string, timeout);
# peer: the other worker of the room failed or died; timeout: a worker-side deadline;
# drain: shutdown aborted what did not finish within the drain timeout.
# why the router's admission refused a request (pdserve.frontend.admission.Rejection)
ADMISSION_REJECTIONS = ("queue_full", "queue_timeout", "too_large", "no_worker")
ROUTING_REASONS = ("prefix", "balance", "load")  # pdserve.frontend.routing.Reason
CACHE_QUERY_OUTCOMES = ("answered", "unanswered")  # pdserve.frontend.routing.CacheAwareRouter.ask
ABORT_ORIGINS = ("client", "router", "peer", "timeout", "drain")
FOLLOW_UP_OUTCOMES = ("woken", "expired")  # how a wait for a finished request's next turn ended
OTHER = "other"

# Bucket edges in seconds. Latencies a user sees span 1 ms (a cached short prompt) to many
# minutes (a long generation), so the edges are roughly logarithmic.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0,
                   30.0, 45.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3600.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0, 60.0)
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16,
                0.32, 0.64, 1.28, 2.56, 5.12)


def _name(short: str) -> str:
    return f"{NAMESPACE}:{short}"


class _Base:
    """A registry plus the constant labels every series of this process carries."""

    def __init__(self, role: str, model_name: str) -> None:
        self.role = role
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._const = {"model_name": model_name, "role": role}
        # structured outputs: the router compiles to validate, workers to sample
        self.grammar_cache_lookups = self._counter("grammar_cache_lookups", "Grammar cache lookups by result.",
                                                   "result", ("hit", "miss"))
        self.grammar_compile_seconds = self._histogram("grammar_compile_seconds",
                                                       "Time to compile a grammar (a cache miss).", COMPILE_BUCKETS)
        self.grammar_mask_seconds = self._histogram(
            "grammar_mask_seconds", "CPU time per step to compute and apply the grammar bitmasks.", STEP_BUCKETS)
        self.grammar_matchers_live = self._gauge("grammar_matchers_live",
                                                 "Grammar matchers of running requests (rank 0 of a worker).")

    def _counter(self, short: str, doc: str, label: str | None = None,
                 values: tuple[str, ...] = ()) -> Counter:
        names = [*self._const, *([label] if label else [])]
        metric = Counter(_name(short), doc, names, registry=self.registry)
        if label is None:
            return metric.labels(**self._const)
        if values:  # a fixed set: every value is rendered (as 0) before its first use
            for value in (*values, OTHER):
                metric.labels(**self._const, **{label: value})
        return metric

    def _gauge(self, short: str, doc: str) -> Gauge:
        return Gauge(_name(short), doc, list(self._const), registry=self.registry).labels(**self._const)

    def _histogram(self, short: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(_name(short), doc, list(self._const), buckets=buckets,
                         registry=self.registry).labels(**self._const)

    def _inc(self, metric: Counter, label: str, value: str, allowed: tuple[str, ...] | None,
             amount: float = 1) -> None:
        if allowed is not None and value not in allowed:
            value = OTHER
        metric.labels(**self._const, **{label: value}).inc(amount)

    def grammar_compiled(self, seconds: float, cached: bool) -> None:
        """A grammar was looked up (structured outputs): its compile time when not cached."""
        self._inc(self.grammar_cache_lookups, "result", "hit" if cached else "miss", ("hit", "miss"))
        if not cached:
            self.grammar_compile_seconds.observe(seconds)

    def grammar_masked(self, seconds: float, rows: int) -> None:
        """One step's grammar bitmasks (all its constrained rows) computed and applied."""
        self.grammar_mask_seconds.observe(seconds)

    def grammar_matchers(self, live: int) -> None:
        """Matchers started and not yet released (they end with their request or preemption)."""
        self.grammar_matchers_live.set(live)

    def render(self) -> bytes:
        """The Prometheus text exposition of this process's metrics (GET /metrics)."""
        return generate_latest(self.registry)


class WorkerMetrics(_Base):
    """What rank 0 of a prefill, decode or combined worker exposes."""

    def __init__(self, role: str, model_name: str) -> None:
        if role not in ("prefill", "decode", "both"):
            raise ValueError(f"worker role must be prefill, decode or both, not {role!r}")
        super().__init__(role, model_name)
        self.num_requests_running = self._gauge(
            "num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = self._gauge(
            "num_requests_waiting", "Requests queued: not yet admitted (or awaiting their KV).")
        self.kv_blocks_used = self._gauge("kv_blocks_used", "KV cache blocks in use (per rank).")
        self.kv_blocks_total = self._gauge("kv_blocks_total", "KV cache blocks in the pool (per rank).")
        self.kv_cache_usage_perc = self._gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use, 0 to 1.")
        self.request_queue_time = self._histogram(
            "request_queue_time_seconds", "Time from arrival at the worker to admission.",
            REQUEST_BUCKETS)
        self.request_prefill_time = self._histogram(
            "request_prefill_time_seconds", "Time spent in prefill (all chunks).", REQUEST_BUCKETS)
        self.request_decode_time = self._histogram(
            "request_decode_time_seconds", "Time from the first decode step to the finish.",
            REQUEST_BUCKETS)
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.request_success = self._counter(
            "request_success", "Requests finished, by finish reason.", "finished_reason",
            FINISH_REASONS)
        self.rooms = self._counter(
            "rooms", "KV transfer rooms that reached a terminal state, by state.", "state",
            ROOM_STATES)
        self.kv_transfer_time = self._histogram(
            "kv_transfer_seconds", "Time of one room's KV transfer, first write to completion.",
            TRANSFER_BUCKETS)
        self.kv_transfer_bytes = self._counter("kv_transfer_bytes", "KV bytes transferred.")
        self.kv_transfer_failures = self._counter(
            "kv_transfer_failures", "KV transfers that failed (the room ended FAILED).")
        self.aborts = self._counter("aborts", "Requests aborted, by who asked.", "origin",
                                    ABORT_ORIGINS)
        self.kv_rooms_live = self._gauge(
            "kv_rooms_live", "KV transfer rooms open on this worker's rank 0 (not ended yet).")
        self.kv_writes_in_flight = self._gauge(
            "kv_writes_in_flight", "KV writes posted by rank 0 and not completed yet (prefill).")
        self.kv_rooms_failed_peer_dead = self._counter(
            "kv_rooms_failed_peer_dead",
            "Rooms open when their peer worker died (killed, restarted or forgotten): failed.")
        self.late_messages_dropped = self._counter(
            "late_messages_dropped",
            "Messages for rooms that had already ended or were never known, dropped.")
        self.prefix_cache_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).")
        self.prefix_cache_host_hits = self._counter(
            "prefix_cache_host_hits", "Prompt tokens of those hits loaded back from the host-memory tier.")
        # the two tiers: what each holds and what each gives up
        self.kv_blocks_cached = self._gauge(
            "kv_blocks_cached", "Device KV blocks holding cached prefix content that no request holds (evictable).")
        self.prefix_cache_evictions = self._counter(
            "prefix_cache_evictions", "Cached device blocks evicted for new content (saved to the host tier if any).")
        self.host_cache_blocks_used = self._gauge(
            "host_cache_blocks_used", "Host-memory tier blocks holding a copy of an evicted device block.")
        self.host_cache_blocks_total = self._gauge(
            "host_cache_blocks_total", "Blocks of the host-memory tier (0: --host-cache-memory not set).")
        self.host_cache_drops = self._counter(
            "host_cache_drops", "Host-memory copies dropped (least recently used first) to make room.")
        self.prefix_cache_forgotten = self._counter(
            "prefix_cache_forgotten_blocks", "Cached device blocks forgotten by POST /reset_prefix_cache.")
        self.num_preemptions = self._counter(
            "num_preemptions", "Running requests preempted (their KV dropped, recomputed later).")
        self.follow_up_waits = self._counter(
            "follow_up_waits", "Steps that waited for a finished request's next turn, by how the wait "
            "ended: woken (a request or an abort came) or expired.", "outcome", FOLLOW_UP_OUTCOMES)
        self.follow_up_wait_time = self._counter(
            "follow_up_wait_seconds", "Time the loop waited for finished requests' next turns.")
        self._scheduler_totals: dict[str, int] = {}
        self.scheduler_step_time = self._histogram(
            "scheduler_step_seconds", "Time of one scheduler iteration (observe to apply).",
            STEP_BUCKETS)
        self.scheduler_agree_time = self._histogram(
            "scheduler_agree_seconds",
            "Time of the agree and broadcast collectives of one iteration.", STEP_BUCKETS)

    def set_load(self, *, running: int, waiting: int, used_blocks: int, total_blocks: int) -> None:
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_blocks_used.set(used_blocks)
        self.kv_blocks_total.set(total_blocks)
        self.kv_cache_usage_perc.set(used_blocks / total_blocks if total_blocks else 0.0)

    def request_finished(self, reason: str, *, prompt_tokens: int = 0, generation_tokens: int = 0,
                         queue_s: float | None = None, prefill_s: float | None = None,
                         decode_s: float | None = None) -> None:
        self._inc(self.request_success, "finished_reason", reason, FINISH_REASONS)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        for hist, value in ((self.request_queue_time, queue_s),
                            (self.request_prefill_time, prefill_s),
                            (self.request_decode_time, decode_s)):
            if value is not None:
                hist.observe(value)

    def room_ended(self, state: str) -> None:
        """A room reached DONE, FAILED or ABORTED (count once per room)."""
        self._inc(self.rooms, "state", state, ROOM_STATES)
        if state == "failed":
            self.kv_transfer_failures.inc()

    def kv_transferred(self, seconds: float, nbytes: int) -> None:
        self.kv_transfer_time.observe(seconds)
        self.kv_transfer_bytes.inc(nbytes)

    def aborted(self, origin: str) -> None:
        self._inc(self.aborts, "origin", origin, ABORT_ORIGINS)

    def transfer_gauges(self, *, rooms_live: int, writes_in_flight: int) -> None:
        self.kv_rooms_live.set(rooms_live)
        self.kv_writes_in_flight.set(writes_in_flight)

    def cache_tiers(self, *, device_cached: int, host_used: int, host_total: int) -> None:
        self.kv_blocks_cached.set(device_cached)
        self.host_cache_blocks_used.set(host_used)
        self.host_cache_blocks_total.set(host_total)

    def scheduler_counts(self, *, cache_queries: int, cache_hits: int, preemptions: int,
                         host_hits: int = 0, evictions: int = 0, host_drops: int = 0, forgotten: int = 0) -> None:
        """The scheduler's cumulative counts → increments since the last call."""
        for metric, key, total in ((self.prefix_cache_queries, "queries", cache_queries),
                                   (self.prefix_cache_hits, "hits", cache_hits),
                                   (self.prefix_cache_host_hits, "host_hits", host_hits),
                                   (self.prefix_cache_evictions, "evictions", evictions),
                                   (self.host_cache_drops, "host_drops", host_drops),
                                   (self.prefix_cache_forgotten, "forgotten", forgotten),
                                   (self.num_preemptions, "preemptions", preemptions)):
            metric.inc(max(total - self._scheduler_totals.get(key, 0), 0))
            self._scheduler_totals[key] = total

    def follow_up_waited(self, seconds: float, woken: bool) -> None:
        self._inc(self.follow_up_waits, "outcome", "woken" if woken else "expired", FOLLOW_UP_OUTCOMES)
        self.follow_up_wait_time.inc(seconds)

    def scheduler_step(self, step_s: float, agree_s: float) -> None:
        self.scheduler_step_time.observe(step_s)
        self.scheduler_agree_time.observe(agree_s)


class RouterMetrics(_Base):
    """What the router exposes: latencies as the client sees them, and parser diagnostics.

    The router's view of a request: *waiting* from its acceptance to its first token (queued
    on a worker, prefilling, transferring), then *running* until it finishes. The two gauges
    never count one request twice, as vLLM's running and waiting do not.
    """

    def __init__(self, model_name: str, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("router", model_name)
        self.clock = clock
        self.num_requests_running = self._gauge(
            "num_requests_running", "Requests at the router that have their first token, not finished.")
        self.num_requests_waiting = self._gauge(
            "num_requests_waiting", "Requests at the router accepted but without a token yet.")
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Time from request arrival to the first token.",
            TTFT_BUCKETS)
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Time between two consecutive output tokens.",
            ITL_BUCKETS)
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds", "Time from request arrival to its finish.",
            REQUEST_BUCKETS)
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens streamed to clients.")
        self.request_success = self._counter(
            "request_success", "Requests finished, by finish reason.", "finished_reason",
            FINISH_REASONS)
        self.aborts = self._counter("aborts", "Requests aborted, by who asked.", "origin",
                                    ABORT_ORIGINS)
        self.request_retries = self._counter(
            "request_retries", "Choices run again on another route after a worker failed them before "
            "their first token.")
        self.parser_diagnostics = self._counter(
            "parser_diagnostics",
            "Output parser diagnostics (markup suppressed, malformed markup), by kind.", "kind")
        self.admission_queue_length = self._gauge(
            "admission_queue_length", "Requests waiting in the router's admission queue for room.")
        self.admission_queue_time = self._histogram(
            "admission_queue_seconds", "Time an admitted request waited in the admission queue.",
            REQUEST_BUCKETS)
        self.admission_rejections = self._counter(
            "admission_rejections", "Requests the admission refused (429, or 503 without workers), by reason.",
            "reason", ADMISSION_REJECTIONS)
        self.responses_stored = self._gauge(
            "responses_stored", "Responses API responses kept for previous_response_id.")
        self.responses_stored_bytes = self._gauge(
            "responses_stored_bytes", "What the kept responses' own items take, as JSON.")
        self.routing_decisions = self._counter(
            "routing_decisions", "Workers chosen for requests, by reason: the likely holder of the "
            "prompt's prefix, the least loaded instead of a too busy holder, or no holder.",
            "reason", ROUTING_REASONS)
        self.routing_cache_queries = self._counter(
            "routing_cache_queries", "Workers asked what they hold of a prompt before it was routed, by "
            "whether they answered in time.", "outcome", CACHE_QUERY_OUTCOMES)
        self.local_prefills = self._counter(
            "local_prefills", "PD requests sent to a decode worker alone, which computes the prompt itself "
            "(it likely held all but --local-prefill-tokens of it).")
        self.tokenizer_reused_tokens = self._counter(
            "tokenizer_reused_tokens", "Chat prompt tokens taken from an earlier prompt's tokenization (a "
            "conversation's previous turn) instead of tokenized again.")

    def start_request(self, prompt_tokens: int, arrival: float | None = None) -> RequestTimer:
        """Call when a request is accepted (`arrival`: when it arrived, on `clock`; default now);
        use the timer as its tokens arrive."""
        self.num_requests_waiting.inc()
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTimer(self, self.clock() if arrival is None else arrival)

    def request_done(self, reason: str, seconds: float, *, had_token: bool) -> None:
        """Normally called by `RequestTimer.finish`."""
        (self.num_requests_running if had_token else self.num_requests_waiting).dec()
        self._inc(self.request_success, "finished_reason", reason, FINISH_REASONS)
        self.e2e_request_latency.observe(seconds)

    def aborted(self, origin: str) -> None:
        self._inc(self.aborts, "origin", origin, ABORT_ORIGINS)

    def retried(self) -> None:
        self.request_retries.inc()

    def watch_admission(self, admission) -> None:
        """Read the queue length from `admission` (a frontend.admission.Admission) at each scrape,
        and count its waits and refusals."""
        self.admission_queue_length.set_function(lambda: admission.queued)
        admission.stats.on_wait = self.admission_queue_time.observe
        admission.stats.on_reject = lambda why: self._inc(self.admission_rejections, "reason", why,
                                                          ADMISSION_REJECTIONS)
        admission.routing.on_decision = lambda why: self._inc(self.routing_decisions, "reason", why,
                                                              ROUTING_REASONS)
        admission.routing.on_local = self.local_prefills.inc
        admission.routing.on_ask = lambda answered: self._inc(
            self.routing_cache_queries, "outcome", "answered" if answered else "unanswered", CACHE_QUERY_OUTCOMES)

    def watch_prompts(self, prompts) -> None:
        """Count what `prompts` (a frontend.prompts.PromptBuilder) reuses of earlier tokenizations."""
        prompts.prefixes.on_reuse = self.tokenizer_reused_tokens.inc

    def watch_responses(self, store) -> None:
        """Read the size of `store` (a frontend.response_store.ResponseStore) at each scrape."""
        self.responses_stored.set_function(lambda: len(store))
        self.responses_stored_bytes.set_function(lambda: store.bytes)

    def parser_diagnostic(self, kind: str) -> None:
        """`kind` is a parser `Diag` value (a fixed enum, so the label set stays bounded)."""
        self._inc(self.parser_diagnostics, "kind", kind, None)


class RequestTimer:
    """TTFT, inter-token latency and end-to-end latency of one request at the router, and its
    place in the waiting/running gauges."""

    def __init__(self, metrics: RouterMetrics, start: float) -> None:
        self._m = metrics
        self._start = start
        self._first: float | None = None
        self._last: dict[int, float] = {}   # per choice: when its latest tokens came
        self._finished = False

    def tokens(self, n: int, choice: int = 0) -> None:
        """`n` output tokens of one choice arrived together (one chunk of the decode stream).

        The request's first token gives TTFT; every later token of a choice one inter-token
        sample: a chunk of n tokens after a gap g counts n samples of g/n (and the rest of a
        choice's first chunk, which came with its first token, counts samples of 0).
        """
        if n <= 0 or self._finished:
            return
        now = self._m.clock()
        self._m.generation_tokens.inc(n)
        if self._first is None:
            self._first = now
            self._m.time_to_first_token.observe(now - self._start)
            self._m.num_requests_waiting.dec()
            self._m.num_requests_running.inc()
        last = self._last.get(choice)
        gaps = [0.0] * (n - 1) if last is None else [(now - last) / n] * n
        for gap in gaps:
            self._m.inter_token_latency.observe(gap)
        self._last[choice] = now

    def finish(self, reason: str) -> None:
        """Idempotent: the first call counts, later ones (abort after finish) do nothing."""
        if self._finished:
            return
        self._finished = True
        self._m.request_done(reason, self._m.clock() - self._start, had_token=self._first is not None)
