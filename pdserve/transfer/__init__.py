"""KV transfer service: rooms, the notification wire format, and the NIXL backend.

The NIXL classes live in `nixl_target` / `nixl_source` (importing them loads NIXL); this
package itself imports only the pure parts, so the router and unit tests never need NIXL.
"""
from .base import TransferConfig, TransferSource, TransferTarget
from .bootstrap import BootstrapInfo, agent_name
from .events import (Fenced, PeerConnected, PeerDead, RoomAborted, RoomDone, RoomFailed,
                     RoomWritten, SourceEvent, TargetEvent)
from .layout import LayoutMismatch, PoolLayout
from .rooms import Outcome, Room, RoomEvent, RoomState, RoomTable, step

__all__ = [
    "BootstrapInfo", "Fenced", "LayoutMismatch", "Outcome", "PeerConnected", "PeerDead",
    "PoolLayout", "Room", "RoomAborted", "RoomDone", "RoomEvent", "RoomFailed", "RoomState",
    "RoomTable", "RoomWritten", "SourceEvent", "TargetEvent", "TransferConfig",
    "TransferSource", "TransferTarget", "agent_name", "step",
]
