"""What a transfer agent reports from `poll()`. Plain values; the scheduler turns them into
per-rank observations (a room is complete only when complete on every TP rank)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class RoomDone:
    """Decode side: every block of the room landed, then the completion payload."""

    room: str
    payload: bytes
    peer: str


@dataclass(frozen=True)
class RoomWritten:
    """Prefill side: the write and its completion notification were delivered; the source
    blocks are free again."""

    room: str
    peer: str


@dataclass(frozen=True)
class RoomFailed:
    """The room ended FAILED. Its blocks are reusable only after `Fenced`. `peer_dead`: because
    the other worker's process is gone, not for a fault of this room (the router answers 503)."""

    room: str
    reason: str
    peer_dead: bool = False


@dataclass(frozen=True)
class RoomAborted:
    """The peer aborted the room (our own aborts are not echoed). Blocks wait for `Fenced`."""

    room: str
    peer: str


@dataclass(frozen=True)
class Fenced:
    """The blocks of a FAILED or ABORTED room are reusable: nothing can write them any more."""

    room: str
    reason: str


@dataclass(frozen=True)
class PeerConnected:
    peer: str


@dataclass(frozen=True)
class PeerDead:
    """The peer disconnected (killed, restarted, or forgotten); its rooms failed and fenced."""

    peer: str
    reason: str


TargetEvent = Union[RoomDone, RoomFailed, RoomAborted, Fenced, PeerConnected, PeerDead]
SourceEvent = Union[RoomWritten, RoomFailed, RoomAborted, Fenced, PeerDead]
