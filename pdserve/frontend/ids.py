"""Request ids: the client's X-Request-Id (or a fresh one), and the ids workers see.

Workers keep a tombstone for every room that ended and refuse a room id they have seen, so a
client that reuses its X-Request-Id (a retry) must not reuse the room id: the second use of an
id within the remembered window gets a suffix. Per choice the room id is ``<id>-<i>`` when the
request has more than one choice.
"""
from __future__ import annotations

import re
import uuid
from collections import OrderedDict

from pdserve.frontend.errors import invalid

_VALID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


class RequestIds:
    def __init__(self, remember: int = 65536) -> None:
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._remember = remember

    @staticmethod
    def client_id(header: str | None) -> str:
        """The X-Request-Id to answer with: the client's if well-formed, else a new one."""
        if header is None or header == "":
            return uuid.uuid4().hex
        if not _VALID.fullmatch(header):
            raise invalid("X-Request-Id must be 1-128 printable ASCII characters without spaces",
                          "X-Request-Id")
        return header

    def room_base(self, client_id: str) -> str:
        """A worker-side id derived from `client_id`, never handed out twice in the window."""
        uses = self._seen.pop(client_id, 0)
        self._seen[client_id] = uses + 1
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        return client_id if uses == 0 else f"{client_id}~{uses}"


def room_ids(base: str, count: int) -> list[str]:
    return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
