"""The NIXL/UCX transport: one agent, its registered pool, its peers, its transfer handles.

The only module that imports nixl. Rules it enforces (docs/kv-transfer.md):
* progress thread off: the owner polls; the agent is used by one thread only (`ThreadGuard`);
* a transfer handle is used only by the thread that made it and released exactly once; a
  released handle is never passed to NIXL again (`XferHandle`), since use after release can
  crash the process;
* NIXL exceptions are mapped: a remote disconnect is `PeerGone`, anything else `TransportError`.
"""
from __future__ import annotations

import logging
import threading
from enum import Enum
from typing import Any

import numpy as np

from .layout import PoolLayout
from .wire import Message, encode

logger = logging.getLogger(__name__)


def _load_nixl() -> tuple[Any, Any, Any, tuple[type[BaseException], ...]]:
    from nixl import _bindings
    from nixl._api import nixl_agent, nixl_agent_config

    errors = tuple(getattr(_bindings, n) for n in dir(_bindings)
                   if n.startswith("nixl") and n.endswith("Error"))
    return nixl_agent, nixl_agent_config, _bindings.nixlRemoteDisconnectError, errors


class TransportError(RuntimeError):
    """NIXL refused or failed an operation (bad descriptor, unknown agent, backend error)."""


class PeerGone(TransportError):
    """The remote agent disconnected (process died or restarted)."""

    def __init__(self, peer: str, detail: str = ""):
        super().__init__(f"peer {peer} disconnected{': ' + detail if detail else ''}")
        self.peer = peer


class WrongThread(RuntimeError):
    """A NIXL object was used from a thread other than its owner (the agent is not
    thread-safe and handles belong to the thread that made them)."""


class HandleReleased(RuntimeError):
    """A transfer handle was used after release: refused here, before NIXL could crash."""


class XferStatus(Enum):
    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


class ThreadGuard:
    """Binds to the first thread that uses it; any other thread is refused while the owner
    lives (after it ended, e.g. a scheduler thread that stopped, the next user takes over)."""

    def __init__(self, what: str):
        self.what = what
        self._owner: threading.Thread | None = None

    def check(self) -> None:
        me = threading.current_thread()
        if self._owner is me:
            return
        if self._owner is not None and self._owner.is_alive():
            raise WrongThread(f"{self.what} is owned by thread {self._owner.name}, "
                              f"used from {me.name}")
        self._owner = me


class XferHandle:
    """One NIXL transfer request. `release()` exactly once; afterwards every call raises."""

    def __init__(self, endpoint: NixlEndpoint, raw: Any, peer: str):
        self._ep, self._raw, self.peer = endpoint, raw, peer
        self.released = False

    def _use(self) -> Any:
        if self.released:
            raise HandleReleased(f"transfer handle to {self.peer} used after release")
        self._ep.guard.check()
        return self._raw

    def post(self) -> XferStatus:
        raw = self._use()
        return XferStatus(self._ep.call(self.peer, self._ep.agent.transfer, raw))

    def state(self) -> XferStatus:
        raw = self._use()
        return XferStatus(self._ep.call(self.peer, self._ep.agent.check_xfer_state, raw))

    def release(self) -> None:
        raw = self._use()
        self.released, self._raw = True, None
        try:
            self._ep.agent.release_xfer_handle(raw)
        except self._ep.errors as e:
            # NIXL keeps such a handle alive and retries in its finalizer; keep ours with the
            # endpoint so that finalizer runs at close, on the owner thread, not at random.
            logger.warning("release of a transfer handle to %s failed: %s", self.peer, e)
            self._ep.unreleasable.append(raw)


class NixlEndpoint:
    """A NIXL agent with the pool registered and one prepared descriptor list per side."""

    def __init__(self, name: str, layout: PoolLayout):
        nixl_agent, nixl_agent_config, self._disconnect, self.errors = _load_nixl()
        self.name, self.layout = name, layout
        self.guard = ThreadGuard(f"transfer agent {name}")
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                   backends=["UCX"])
        self.agent = nixl_agent(name, config)
        if "UCX" not in self.agent.backends:
            raise TransportError("NIXL UCX backend unavailable")
        self._reg = self.agent.register_memory(layout.registration(), layout.mem_type)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", layout.descriptors(),
                                                 layout.mem_type)
        self.metadata = bytes(self.agent.get_agent_metadata())  # for bootstrap, any thread
        self._remote: dict[str, Any] = {}  # peer -> prepared remote descriptor list (sources)
        self._peers: set[str] = set()
        self.unreleasable: list[Any] = []
        self._closed = False

    def call(self, peer: str, fn: Any, *args: Any) -> Any:
        """Run a NIXL call about `peer`, mapping its exceptions."""
        try:
            return fn(*args)
        except self._disconnect as e:
            raise PeerGone(peer, str(e)) from e
        except self.errors as e:
            raise TransportError(f"{type(e).__name__}: {e}") from e

    def add_peer(self, peer: str, metadata: bytes, layout: PoolLayout | None = None) -> None:
        """Load a peer's metadata, replacing a previous incarnation (NIXL refuses to load a
        known name again); with `layout`, prepare its descriptor list for writes into it."""
        self.guard.check()
        self.remove_peer(peer)
        loaded = self.call(peer, self.agent.add_remote_agent, metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != peer:
            self.agent.remove_remote_agent(loaded)
            raise TransportError(f"metadata names agent {loaded!r}, expected {peer!r}")
        self._peers.add(peer)
        if layout is not None:
            self._remote[peer] = self.call(peer, self.agent.prep_xfer_dlist, peer,
                                           layout.descriptors(), layout.mem_type)

    def remove_peer(self, peer: str) -> None:
        """Idempotent: forget the peer's descriptors and metadata (disconnects)."""
        self.guard.check()
        dlist = self._remote.pop(peer, None)
        if dlist is not None:
            try:
                self.agent.release_dlist_handle(dlist)
            except self.errors as e:
                logger.warning("releasing descriptors of %s: %s", peer, e)
        if peer in self._peers:
            self._peers.discard(peer)
            try:
                self.agent.remove_remote_agent(peer)
            except self.errors as e:
                logger.warning("removing agent %s: %s", peer, e)

    def send(self, peer: str, msg: Message) -> None:
        """Standalone notification. Raises PeerGone if the peer is dead."""
        self.guard.check()
        if peer not in self._peers:
            raise TransportError(f"unknown peer {peer}")
        self.call(peer, self.agent.send_notif, peer, encode(msg))

    def receive(self) -> list[tuple[str, bytes]]:
        """New notifications, in arrival order per peer. Also drives UCX progress."""
        self.guard.check()
        notifs = self.call(self.name, self.agent.get_new_notifs)
        return [(peer, bytes(m)) for peer, msgs in notifs.items() for m in msgs]

    def make_write(self, peer: str, local_idx: np.ndarray, remote_idx: np.ndarray,
                   notif: bytes) -> XferHandle:
        self.guard.check()
        remote = self._remote.get(peer)
        if remote is None:
            raise TransportError(f"not connected to {peer}")
        raw = self.call(peer, self.agent.make_prepped_xfer, "WRITE", self._local, local_idx,
                        remote, remote_idx, notif)
        return XferHandle(self, raw, peer)

    def close(self) -> None:
        """Unload peers, release descriptor lists, deregister the pool. Idempotent."""
        if self._closed:
            return
        self.guard.check()
        self._closed = True
        for peer in list(self._peers):
            self.remove_peer(peer)
        try:
            self.agent.release_dlist_handle(self._local)
            self.agent.deregister_memory(self._reg)
        except self.errors as e:
            logger.warning("closing transfer agent %s: %s", self.name, e)


def receive_messages(ep: "NixlEndpoint", counters, owner: str) -> list:
    """The notifications that arrived, as (peer, raw); a transport error is counted and logged
    (and yields none this time: the next poll tries again)."""
    try:
        return ep.receive()
    except TransportError as e:
        counters["receive_errors"] += 1
        logger.warning("%s: receiving notifications: %s", owner, e)
        return []


def send_message(ep: "NixlEndpoint", peer: str, msg, on_dead, counters, owner: str) -> bool:
    """Send a notification; a dead peer goes to `on_dead(peer, reason)`, any other transport
    error is counted and logged. True when sent."""
    try:
        ep.send(peer, msg)
        return True
    except PeerGone as e:
        on_dead(peer, str(e))
    except TransportError as e:
        counters["send_errors"] += 1
        logger.warning("%s: sending %s to %s: %s", owner, type(msg).__name__, peer, e)
    return False
