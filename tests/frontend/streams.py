"""Reading SSE streams in fault tests: every stream must end with `data: [DONE]` or with an
error event (a `data:` object with "error"), whatever happened to the server. A stream cut
without either (a reset connection, an incomplete chunked body) fails the test."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class StreamEnd:
    done: bool = False              # ended with [DONE]
    error: dict | None = None       # ended with this error object
    events: int = 0                 # data events before the end
    ended_at: float = 0.0           # time.monotonic() of the last line
    cut: str | None = None          # how it broke, when it ended with neither
    text: str = ""                  # the first choice's content, as streamed

    def assert_clean(self) -> None:
        assert self.cut is None and (self.done or self.error is not None), \
            f"the stream ended with neither [DONE] nor an error event after {self.events} events: {self.cut}"


def read_stream(url: str, body: dict, started: threading.Event | None = None, after: int = 2,
                timeout_s: float = 120.0) -> StreamEnd:
    """POST a streaming `body` to `url`; set `started` once `after` events came."""
    end = StreamEnd()
    try:
        with httpx.stream("POST", url, json={"model": MODEL, **body, "stream": True},
                          timeout=timeout_s) as r:
            if r.status_code != 200:
                end.cut = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                return end
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                end.ended_at = time.monotonic()
                if data == "[DONE]":
                    end.done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    end.error = obj["error"]
                    break
                end.events += 1
                for choice in obj.get("choices", []):
                    if choice.get("index", 0) == 0:
                        end.text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if started is not None and end.events >= after:
                    started.set()
    except httpx.HTTPError as e:
        end.cut = f"{type(e).__name__}: {e}"
        end.ended_at = time.monotonic()
    finally:
        if started is not None:
            started.set()  # never leave a waiter hanging
    return end


@dataclass
class Streams:
    """Several streams in threads; `wait_started` once each has its first events."""

    url: str
    body: dict
    count: int
    ends: list[StreamEnd | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ends = [None] * self.count
        self._started = [threading.Event() for _ in range(self.count)]
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.count)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        self.ends[i] = read_stream(self.url, self.body, self._started[i])

    def wait_started(self, timeout_s: float = 120.0) -> None:
        for ev in self._started:
            assert ev.wait(timeout_s), "a stream did not start"

    def join(self, timeout_s: float = 120.0) -> list[StreamEnd]:
        for t in self._threads:
            t.join(timeout_s)
        assert all(e is not None for e in self.ends), "a stream did not end"
        for e in self.ends:
            e.assert_clean()
        return list(self.ends)
