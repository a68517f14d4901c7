"""Router settings: one dataclass, built from CLI flags (or keyword arguments in tests)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RouterConfig:
    model_dir: Path                       # the tokenizer and chat template come from here
    served_model_name: str                # what /v1/models lists and requests must name
    aliases: tuple[str, ...] = ()         # other names accepted in "model" (e.g. the --model path)
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    worker_urls: list[str] = field(default_factory=list)   # colocated workers (role "both")
    # NAME:PORT of headless Services: the workers of a role are the A records of NAME, resolved
    # every `discover_interval_s` (on Kubernetes, one record per ready pod).
    discover_prefill: list[str] = field(default_factory=list)
    discover_decode: list[str] = field(default_factory=list)
    discover_worker: list[str] = field(default_factory=list)
    discover_interval_s: float = 5.0
    api_key: str | None = None
    stream_batch: int = 1                 # up to this many tokens per SSE event
    max_request_bytes: int = 8 << 20      # larger bodies get 413
    max_model_len: int | None = None      # None: the smallest of the workers' /info
    tool_call_parser: str | None = None   # a pdserve.parsers.PARSER_NAMES name; None: from the model
    health_interval_s: float = 0.5        # how often every worker's /health and /load are polled
    idle_health_interval_s: float = 2.0   # ... when nothing runs on it (an idle server costs nothing)
    health_timeout_s: float = 5.0         # one probe's deadline (a late answer still shows life)
    slow_after_s: float = 3.0             # no answer for this long: slow, no new requests (docs/liveness.md)
    dead_after_s: float = 30.0            # no answer at all for this long: dead, in-flight failed
    max_queue: int = 256                  # requests waiting for room (admission.py); more get 429
    queue_timeout_s: float = 30.0         # how long one waits for room before its 429
    worker_capacity: int | None = None    # choices per worker (None: 2 × its max_num_seqs)
    max_running: int | None = None        # choices running router-wide (None: the workers' sum)
    routing: str = "cache-aware"          # cache-aware | least-loaded (routing.py)
    ask_caches: bool = True               # cache-aware: ask the workers what they hold (--no-ask-caches)
    local_prefill_tokens: int = 0         # PD: a prompt with at most this many uncached tokens skips prefill
    scheduling_policy: str = "fcfs"       # fcfs | priority: the admission queue by requests' priority
    retries: int = 1                      # a choice its worker failed runs again, from the start or its last token
    internal_token: str | None = None     # sent to the workers' internal API (PDSERVE_INTERNAL_TOKEN)
    wedged_grace_s: float = 30.0          # a worker reporting "wedged" this long: in-flight failed
    abort_timeout_s: float = 2.0
    connect_timeout_s: float = 3.0
    inline_tokenize_chars: int = 4096     # longer prompts are tokenized off the event loop
    drain_timeout_s: float = 30.0         # SIGTERM: how long in-flight requests may finish
    loop_stall_s: float = 5.0             # /health fails when the event loop lagged this long
    responses_store: int = 1024           # Responses kept for previous_response_id (0: none)

    def __post_init__(self) -> None:
        if self.stream_batch < 1:
            raise ValueError("stream_batch must be >= 1")
        if self.retries < 0:
            raise ValueError("retries must be >= 0")
        if self.responses_store < 0:
            raise ValueError("responses_store must be >= 0")
        colocated = self.worker_urls or self.discover_worker
        if not colocated and not ((self.prefill_urls or self.discover_prefill)
                                  and (self.decode_urls or self.discover_decode)):
            raise ValueError("give prefill and decode workers (--prefill/--decode URLs or "
                             "--discover-prefill/--discover-decode NAME:PORT), or colocated ones "
                             "(--worker, --discover-worker)")

    @property
    def model_names(self) -> frozenset[str]:
        return frozenset((self.served_model_name, *self.aliases))

