"""Follow-ups: how soon a finished request's conversation comes back, and whether a step waits.

An agent sends its next turn as soon as it has read the last answer (a tool's result, the next
question): the conversation comes back to the worker a few milliseconds after its previous turn
finished. Sessions that run together decode together and finish one step apart, so on a CPU,
where a cached turn's prompt step is several decode steps long, each session's next turn arrives
a few milliseconds into another session's prompt step and waits for all of it before its own
(the sessions' convoy, docs/follow-ups.md). Waiting those few milliseconds before the next
decode-only step, the anticipatory scheduling of disk I/O, lets the turn run in that step
instead: the sessions' prompts stop queueing behind each other.

Waiting only pays when turns come back, so the planner keeps score. A finish is *followed* when
a prompt that continues it (it starts with the finished prompt, give or take the few tokens a
chat template rewrites at the end) arrives soon enough: within the wait when the step waited,
within twice the wait when it did not (a forward then holds the cores, which slows the turn's
way back). Steps wait while the score, a moving average of followed finishes, says that most
are followed. Requests that do not continue a finished one (independent clients) never count,
so with them the waits stop after a new worker's first three finishes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# each finish moves the score this far towards 1 (followed) or 0 (not)
WEIGHT = 0.25
# a new worker expects follow-ups (a server's first finishes are often a client's warm-up, which
# no turn follows); a step waits while the score is at least THRESHOLD: three unfollowed finishes
# in a row stop the waits, and one followed finish starts them again
START, THRESHOLD = 1.0, 0.5
# a finish that no step waited for is followed if its next turn comes within this many waits
UNWAITED = 2.0
# a next turn starts with the finished prompt, but for the last few tokens (a template may
# rewrite the assistant's opening: DeepSeek's `<think>`); these many tokens at each end of the
# rest are compared
SLACK, PROBE = 8, 16


@dataclass
class _Finish:
    at: float
    prompt: list[int]
    limit: float  # followed only if its next turn arrives this soon after `at`


class FollowUps:
    """The planner's record of finishes and of the prompts that continue them (rank 0 only; its
    decisions reach the other ranks in the plan). `window_s`: the longest wait; 0: never wait."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.score = START
        self._finishes: deque[_Finish] = deque()  # not followed yet, oldest first

    def finished(self, prompt: list[int], at: float, waited: bool) -> None:
        """A request of `prompt` finished: its last output went out at `at`; `waited`: the step
        that handed it out waits for a follow-up."""
        self.expire(at)
        limit = self.window_s * (1.0 if waited else UNWAITED)
        self._finishes.append(_Finish(at, prompt, limit))

    def arrived(self, prompt: list[int], at: float) -> None:
        """A prompt to compute here arrived at `at`: it follows the oldest finish it continues."""
        self.expire(at)
        for f in self._finishes:
            if f.at <= at and _continues(prompt, f.prompt):
                self._finishes.remove(f)
                self._score(1.0)
                return

    def expire(self, now: float) -> None:
        """Finishes whose time to be followed has passed are not followed."""
        for f in [f for f in self._finishes if now - f.at > f.limit]:
            self._finishes.remove(f)
            self._score(0.0)

    def wait(self, now: float) -> float:
        """How long a step that hands out a request's last token may wait for its next turn: the
        window while most recent finishes were followed, else 0."""
        self.expire(now)
        return self.window_s if self.window_s > 0 and self.score >= THRESHOLD else 0.0

    def _score(self, followed: float) -> None:
        self.score += WEIGHT * (followed - self.score)


def _continues(prompt: list[int], finished: list[int]) -> bool:
    """`prompt` starts with `finished` but for its last SLACK tokens (checked at both ends)."""
    end = len(finished) - SLACK
    if end <= 0 or len(prompt) <= end:
        return False
    head, start = min(PROBE, end), max(end - PROBE, 0)
    return prompt[:head] == finished[:head] and prompt[start:end] == finished[start:end]
