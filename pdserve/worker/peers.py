"""Which worker (and which process of it) is the other side of each PD room here: what a
"peer dead" notice (POST /peers/dead) needs to pick the rooms to fail.

Rank 0 only, on the asyncio thread. A room is remembered from its call until `keep_s` after the
call ended: an aborted room holds its blocks until fenced, and a notice is what fences it when
its peer died. The incarnation tells two processes with the same worker id apart: a notice
about a dead process never touches the rooms of its successor.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

KEEP_S = 120.0  # past the transfer's fence lease (30 s): a later notice has nothing left to fence


class PeerRef(NamedTuple):
    worker_id: str
    incarnation: str | None


class PeerRooms:
    def __init__(self, keep_s: float = KEEP_S, clock: Callable[[], float] = time.monotonic):
        self.keep_s, self.clock = keep_s, clock
        self._rooms: dict[str, PeerRef] = {}
        self._ended: OrderedDict[str, float] = OrderedDict()  # in the order the calls ended

    def add(self, room: str, worker_id: str, incarnation: str | None) -> None:
        self._prune()
        self._rooms[room] = PeerRef(worker_id, incarnation or None)
        self._ended.pop(room, None)

    def ended(self, room: str) -> None:
        """The room's call ended; it is forgotten `keep_s` later."""
        if room in self._rooms and room not in self._ended:
            self._ended[room] = self.clock()

    def take(self, worker_id: str, incarnation: str | None) -> list[str]:
        """The rooms shared with that process, forgotten here (a notice settles them for good):
        its worker id, and its incarnation when both the notice and the room know one (a room
        made without one counts as the dead process's)."""
        self._prune()
        rooms = [room for room, ref in self._rooms.items() if ref.worker_id == worker_id
                 and (not incarnation or ref.incarnation is None or ref.incarnation == incarnation)]
        for room in rooms:
            del self._rooms[room]
            self._ended.pop(room, None)
        return rooms

    def __len__(self) -> int:
        return len(self._rooms)

    def _prune(self) -> None:
        now = self.clock()
        while self._ended:
            room, at = next(iter(self._ended.items()))
            if now - at <= self.keep_s:
                break
            del self._ended[room]
            self._rooms.pop(room, None)
