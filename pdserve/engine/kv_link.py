"""The engine's side of the KV transfer: turns transfer events into observations, and the
plan's decisions into transfer calls (expect, write, abort) on this rank's agent.

Everything here runs on the scheduler thread, the only thread that touches the agent.
"""
from __future__ import annotations

import json
import logging

from pdserve.engine.sequence import FinishReason, KVRole, Sequence, TokenLogprobs
from pdserve.logs import about
from pdserve.scheduler.plan import (KVPeer, SampledToken, StepOutput, StepPlan, TransferKind,
                                    TransferOutcome)
from pdserve.transfer import (Fenced, RoomAborted, RoomDone, RoomFailed, RoomWritten, TransferSource,
                              TransferTarget, agent_name)

logger = logging.getLogger(__name__)


def encode_first_token(tok: SampledToken, prompt_logprobs: list[TokenLogprobs | None] | None = None) -> bytes:
    lp = tok.logprobs
    body = {"t": tok.token_id, "lp": None if lp is None else [lp.logprob, lp.top], "c": tok.cached_tokens}
    if prompt_logprobs:  # rank 0's, with the first token (echo / prompt_logprobs)
        body["plp"] = [None if e is None else [e.token_id, e.logprob, e.top] for e in prompt_logprobs]
    return json.dumps(body).encode()


def decode_first_token(room: str, payload: bytes) -> SampledToken:
    d = json.loads(payload)
    lp = d.get("lp")
    return SampledToken(room, int(d["t"]), None if lp is None else
                        TokenLogprobs(int(d["t"]), float(lp[0]), [(int(a), float(b)) for a, b in lp[1]]),
                        int(d.get("c") or 0))


def decode_prompt_logprobs(payload: bytes) -> list[TokenLogprobs | None] | None:
    """The prompt logprobs that came with a first token, if any (see `encode_first_token`)."""
    entries = json.loads(payload).get("plp")
    if entries is None:
        return None
    return [None if e is None else TokenLogprobs(int(e[0]), float(e[1]), [(int(a), float(b)) for a, b in e[2]])
            for e in entries]


class KVLink:
    """One rank's transfer agent as the scheduler sees it (decode: a target; prefill: a source)."""

    def __init__(self, agent: TransferTarget | TransferSource, rank: int = 0):
        self.agent, self.rank = agent, rank
        self.is_target = isinstance(agent, TransferTarget)
        self._local: list[TransferOutcome] = []  # outcomes decided here (a refused write, ...)
        self._peers: dict[str, KVPeer] = {}  # prefill: where each admitted request's KV goes
        # decode: prompt logprobs that came with a first token, kept off the plan (its size is
        # fixed) until the token's output is made on this rank (`act`)
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}

    def observe(self) -> list[TransferOutcome]:
        """This rank's transfer results since the last call."""
        out, self._local = self._local, []
        for ev in self.agent.poll():
            if isinstance(ev, RoomDone):
                try:
                    token = decode_first_token(ev.room, ev.payload)
                    prompt = decode_prompt_logprobs(ev.payload)
                    if prompt is not None:
                        self._prompt_logprobs[ev.room] = prompt
                    # the plan takes rank 0's token: the others' would only fill their buffer
                    out.append(TransferOutcome(ev.room, TransferKind.ARRIVED, token if self.rank == 0 else None))
                except (ValueError, KeyError, TypeError) as e:
                    self.agent.abort(ev.room)
                    out.append(failed(ev.room, f"bad completion payload: {e}"))
            elif isinstance(ev, RoomWritten):
                out.append(TransferOutcome(ev.room, TransferKind.WRITTEN))
            elif isinstance(ev, RoomFailed):
                out.append(failed(ev.room, ev.reason, ev.peer_dead))
            elif isinstance(ev, RoomAborted):
                out.append(failed(ev.room, "the other worker aborted the room", aborted=True))
            elif isinstance(ev, Fenced):
                out.append(TransferOutcome(ev.room, TransferKind.FENCED))
        return out

    def act(self, plan: StepPlan, outputs: list[StepOutput], held: dict[str, Sequence]) -> None:
        """Carry out the plan's transfer decisions on this rank (same calls on every rank)."""
        # the other worker of these rooms is dead (its supervisor saw every rank exit): first, so
        # that a room admitted in this same plan is refused by its tombstone
        for reason, rooms in _by_reason(plan.peer_dead).items():
            self.agent.peer_gone(rooms, reason)
            for rid in rooms:
                self._peers.pop(rid, None)
        for rid, _ in plan.aborted:
            self.agent.abort(rid)  # idempotent; unknown rooms become tombstones
            self._peers.pop(rid, None)
        for t in plan.transfers:
            if t.kind is TransferKind.FAILED:  # failed on some rank: stop it on all, so all can fence
                self.agent.abort(t.request_id)
        if self.is_target:
            for out in outputs:
                if out.token_id is not None and out.request_id in self._prompt_logprobs:
                    out.prompt_logprobs = self._prompt_logprobs.pop(out.request_id)
            for rid in [t.request_id for t in plan.transfers] + [rid for rid, _ in plan.aborted]:
                self._prompt_logprobs.pop(rid, None)  # its first token is out, or never will be
            for req in plan.admitted:
                if req.kv is KVRole.DECODE:
                    source = agent_name("prefill", req.peer.worker_id, self.rank)
                    if not self.agent.expect(req.request_id, source):  # a tombstone: aborted already
                        self._fail(req.request_id, "the room was aborted before its KV arrived", aborted=True)
            return
        self._peers.update((r.request_id, r.peer) for r in plan.admitted)
        for out in outputs:
            if out.finish_reason is FinishReason.KV_PENDING:
                self._send(out, held[out.request_id].block_table)

    def _send(self, out: StepOutput, blocks: list[int]) -> None:
        peer = self._peers.pop(out.request_id, None)
        rid = out.request_id
        if peer is None:
            return self._fail(rid, "no decode worker for this room")
        skip = peer.cached_blocks  # the decode worker's cache holds these: only the rest travel
        try:
            name = self.agent.connect(peer.bootstrap[self.rank].encode())
            ok = self.agent.write(rid, name, blocks[skip:], list(peer.blocks),
                                  encode_first_token(SampledToken(rid, out.token_id, out.logprobs,
                                                                 out.cached_tokens or 0), out.prompt_logprobs))
        except Exception as e:  # a transport or layout error fails this room, never the loop
            logger.warning("room %s: cannot write KV to the decode worker: %s", rid, e, extra=about(rid))
            return self._fail(rid, str(e))
        if not ok:  # the agent refused: the other worker aborted the room before the write
            self._fail(rid, "the other worker aborted the room before its KV was sent", aborted=True)

    def _fail(self, rid: str, error: str, aborted: bool = False) -> None:
        self._local += failed_and_fenced(rid, error, aborted)


def _by_reason(pairs) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for rid, reason in pairs:
        out.setdefault(reason, []).append(rid)
    return out


MAX_ERROR_CHARS = 1000  # an outcome travels in a fixed-size observation (lockstep.py)


def failed(rid: str, error: str, peer_dead: bool = False, aborted: bool = False) -> TransferOutcome:
    if len(error) > MAX_ERROR_CHARS:
        error = error[:MAX_ERROR_CHARS - 1] + "…"
    return TransferOutcome(rid, TransferKind.FAILED, error=error, peer_dead=peer_dead, aborted=aborted)


def failed_and_fenced(rid: str, error: str, aborted: bool = False) -> list[TransferOutcome]:
    """A room this rank failed before any write could start: nothing to wait for."""
    return [failed(rid, error, aborted=aborted), TransferOutcome(rid, TransferKind.FENCED)]
