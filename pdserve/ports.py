"""Free TCP ports for processes this machine starts (workers, rank groups, tests)."""
from __future__ import annotations

import random
import socket

# Below Linux's default ephemeral range (32768-60999): a port taken from inside it can be handed
# to an outgoing connection between the moment it is chosen and the moment it is bound.
_LOW, _HIGH = 20000, 32000
_TRIES = 64
_RANDOM = random.SystemRandom()  # not the global state, which tests seed


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` now, chosen at random outside the ephemeral range (so no
    outgoing connection can take it before it is bound); the kernel's pick if none is found."""
    for _ in range(_TRIES):
        port = _RANDOM.randint(_LOW, _HIGH)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
