"""Where the ranks of one TP group run: `nnodes` machines (pods), the same number of ranks on
each, node R holding the consecutive global ranks R*L .. R*L+L-1 (L = ranks per node).

Node 0's first rank is rank 0: it serves the worker API and plans every step. Each node's
first rank runs in the node's main process, the others are its child processes.
"""
from __future__ import annotations

from dataclasses import dataclass

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class TPLayout:
    size: int                 # ranks in the whole TP group (--tp)
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--tp must be at least 1, got {self.size}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not a node of --nnodes {self.nnodes} "
                             f"(0 .. {self.nnodes - 1})")
        if self.size % self.nnodes:
            raise ValueError(f"--tp {self.size} is not divisible by --nnodes {self.nnodes}: every node "
                             "runs the same number of TP ranks")

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def first(self) -> int:
        """The global rank of this node's main process."""
        return self.node_rank * self.per_node

    @property
    def children(self) -> range:
        """The global ranks this node runs as child processes."""
        return range(self.first + 1, self.first + self.per_node)

    def device(self, device: str, rank: int) -> str:
        """Where global rank `rank` computes: plain "cuda" means this node's GPU number
        `rank - first` (one GPU per local rank); an explicit "cuda:N" or "cpu" stays as given."""
        return f"cuda:{rank - self.first}" if device == "cuda" else device

    @property
    def leader(self) -> bool:
        """This node holds rank 0 (it serves the API and plans)."""
        return self.node_rank == 0


def parse_addr(text: str) -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 host in brackets: `[::1]:29500`) → (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {text!r}")
    return host, int(port)
