"""What one agent tells another so that they can exchange blocks: name, incarnation, NIXL
metadata, pool layout. The decode rank hands it to the router (which gives it to the prefill
rank of the same TP index); the prefill rank sends its own to the decode rank in HELLO.

Encoding: UTF-8 JSON, `{"v": 1, "agent": str, "incarnation": hex str, "metadata": base64,
"layout": {"mem_type": "DRAM"|"VRAM", "dev_id": int, "regions": [[base, num_blocks,
block_bytes], ...]}}` (fits in a router HTTP body as is).
"""
from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass

from .layout import PoolLayout

BOOTSTRAP_VERSION = 1
_NAME_PART = re.compile(r"^[A-Za-z0-9_.-]+$")


def agent_name(role: str, worker_id: str, rank: int) -> str:
    """Agent name of one TP rank of one worker: `pdserve-<role>-<worker_id>-tp<rank>`.

    Stable across restarts of the worker, so a restarted peer is recognised by name (and by a
    new incarnation)."""
    for part in (role, worker_id):
        if not _NAME_PART.match(part):
            raise ValueError(f"agent name part {part!r} must match {_NAME_PART.pattern}")
    return f"pdserve-{role}-{worker_id}-tp{rank}"


@dataclass(frozen=True)
class BootstrapInfo:
    agent: str
    incarnation: str  # random per process start: tells a restarted peer from the old one
    metadata: bytes   # nixl get_agent_metadata()
    layout: PoolLayout

    def to_bytes(self) -> bytes:
        return json.dumps({
            "v": BOOTSTRAP_VERSION,
            "agent": self.agent,
            "incarnation": self.incarnation,
            "metadata": base64.b64encode(self.metadata).decode(),
            "layout": self.layout.to_dict(),
        }, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | str) -> BootstrapInfo:
        try:
            d = json.loads(data)
            if d.get("v") != BOOTSTRAP_VERSION:
                raise ValueError(f"unsupported bootstrap version {d.get('v')!r}")
            return cls(str(d["agent"]), str(d["incarnation"]),
                       base64.b64decode(d["metadata"]), PoolLayout.from_dict(d["layout"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed transfer bootstrap info: {e}") from e
