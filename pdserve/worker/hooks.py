"""Fault injection for tests, off unless PDSERVE_TEST_FAULTS is set (JSON), e.g.
`{"1": {"fail_rooms": "victim-", "delay_rooms": "late-", "delay_s": 1.0, "poll_delay_s": 0.05}}`
keyed by TP rank: this rank fails or delays the transfer results of rooms whose id starts with
a prefix, or sleeps before polling its notifications. Used to prove that rank-local faults never
make ranks diverge."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from pdserve.scheduler.plan import TransferOutcome


@dataclass
class TestHooks:
    fail_rooms: str | None = None
    delay_rooms: str | None = None
    delay_s: float = 0.0
    poll_delay_s: float = 0.0

    @classmethod
    def from_env(cls, rank: int) -> "TestHooks":
        spec = json.loads(os.environ.get("PDSERVE_TEST_FAULTS", "{}")).get(str(rank), {})
        return cls(**spec)

    def install(self, engine) -> None:
        link = engine.loop.link
        if link is None or not (self.fail_rooms or self.delay_rooms or self.poll_delay_s):
            return
        observe, held = link.observe, []

        def faulty_observe() -> list[TransferOutcome]:
            if self.poll_delay_s:
                time.sleep(self.poll_delay_s)
            now, out = time.monotonic(), []
            for t in observe():
                if self.fail_rooms and t.request_id.startswith(self.fail_rooms) and t.kind == "arrived":
                    link.agent.abort(t.request_id)
                    out += [TransferOutcome(t.request_id, "failed", error="injected fault"),
                            TransferOutcome(t.request_id, "fenced")]
                elif self.delay_rooms and t.request_id.startswith(self.delay_rooms):
                    held.append((now + self.delay_s, t))
                else:
                    out.append(t)
            out += [t for due, t in held if due <= now]
            held[:] = [(due, t) for due, t in held if due > now]
            return out
        link.observe = faulty_observe
