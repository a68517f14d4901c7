"""What `pdserve serve` does when one of its workers exits: restart it, with a growing delay, or
give up (docs/supervision.md).

A worker (its rank 0 and every rank it spawned) that exits is restarted whole, as a new process
group on the same port with a new worker id, unless the restart policy says not to:

* ``always``: every exit is restarted; ``on-failure`` (the default): a non-zero exit or a death
  by signal; ``never``: no restart, `serve` stops (as before supervision).
* The delay before a restart doubles with every exit that follows the last start closely
  (``backoff_s``, 2×, up to ``max_backoff_s``); a worker that ran for a while starts over.
* A crash loop — more than ``max_restarts`` exits within ``window_s`` — ends `serve` with the
  worker's own last error as one line.

`decide` is pure (the policy, the exit, the history, the clock → a ``Decision``), so it is tested
without processes; the launcher applies its decisions.
"""
from __future__ import annotations

import enum
import json
import re
import signal
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


class RestartPolicy(str, enum.Enum):
    ALWAYS = "always"
    ON_FAILURE = "on-failure"
    NEVER = "never"


@dataclass(frozen=True)
class Supervision:
    """`pdserve serve --restart ...` settings."""

    policy: RestartPolicy = RestartPolicy.ON_FAILURE
    max_restarts: int = 5        # exits within window_s beyond which it is a crash loop
    window_s: float = 60.0
    backoff_s: float = 0.5       # the first restart's delay
    max_backoff_s: float = 30.0
    stable_after_s: float = 30.0  # a worker that ran this long restarts with backoff_s again


@dataclass
class History:
    """One worker slot's past: when it exited, the delay of its last restart."""

    exits: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    delay_s: float = 0.0
    restarts: int = 0


@dataclass(frozen=True)
class Decision:
    restart: bool
    delay_s: float = 0.0
    crash_loop: bool = False  # the reason not to restart: too many exits too fast


def decide(s: Supervision, code: int, started_at: float, now: float, history: History) -> Decision:
    """Whether (and after how long) to restart a worker that exited with `code` at `now` after
    starting at `started_at`; records the exit in `history`."""
    history.exits.append(now)
    if s.policy is RestartPolicy.NEVER or (s.policy is RestartPolicy.ON_FAILURE and code == 0):
        return Decision(False)
    recent = [t for t in history.exits if now - t <= s.window_s]
    if len(recent) > s.max_restarts:
        return Decision(False, crash_loop=True)
    ran = now - started_at
    delay = s.backoff_s if ran >= s.stable_after_s or history.delay_s == 0 else min(
        history.delay_s * 2, s.max_backoff_s)
    history.delay_s = delay
    history.restarts += 1
    return Decision(True, delay)


def describe_exit(code: int) -> str:
    """'exited with code 1' / 'was killed by SIGKILL'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


_ERROR_LINE = re.compile(r"\b(error|exception|failed|fatal)\b|Error:", re.IGNORECASE)
_LOG_PREFIX = re.compile(r"^\S+ \S+ (ERROR|CRITICAL|WARNING|INFO) \S+: ")


def last_error(lines: Iterable[str]) -> str | None:
    """The worker's own last error, as one line: the last output line that reads like one
    (JSON log lines: their message), without the log prefix."""
    found = None
    for raw in lines:
        text, level = raw.strip(), None
        if not text:
            continue
        if text.startswith("{"):
            try:
                record = json.loads(text)
            except ValueError:
                record = None
            if isinstance(record, dict):
                level = str(record.get("level", "")).upper()
                text = (str(record.get("message", "")).splitlines() or [""])[0]
        prefix = _LOG_PREFIX.match(text)
        if prefix:
            level, text = prefix.group(1), text[prefix.end():]
        if level in ("ERROR", "CRITICAL") or (level is None and _ERROR_LINE.search(text)):
            found = text
    return found
