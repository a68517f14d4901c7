"""The notifications exchanged by transfer agents, and their tiny versioned encoding.

Every message is `b"PD" | version:u8 | kind:u8 | body`, big-endian. Body fields:
room = u16 length + UTF-8; bytes/text = u32 length + bytes. Exactly the declared fields; a
message of another version or with trailing bytes is rejected (the receiver counts and drops).

    HELLO  info:bytes             source -> target: its bootstrap info (agent metadata, layout)
    DONE   room, payload:bytes    attached to a write; arrives after the data (first token...)
    ABORT  room                   the sender aborted the room; the receiver aborts it too
    FAIL   room, reason:text      the sender failed the room
    FENCE  room                   no write for the room is, or will be, in flight from the sender
    PING   (empty)                liveness probe; a send to a dead peer raises at once
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Union

MAGIC = b"PD"
VERSION = 1
_HEADER = struct.Struct(">2sBB")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


class WireError(ValueError):
    """Bytes that are not a message of this version."""


class Kind(IntEnum):
    HELLO = 1
    DONE = 2
    ABORT = 3
    FAIL = 4
    FENCE = 5
    PING = 6


@dataclass(frozen=True)
class Hello:
    info: bytes


@dataclass(frozen=True)
class Done:
    room: str
    payload: bytes = b""


@dataclass(frozen=True)
class Abort:
    room: str


@dataclass(frozen=True)
class Fail:
    room: str
    reason: str = ""


@dataclass(frozen=True)
class Fence:
    room: str


@dataclass(frozen=True)
class Ping:
    pass


Message = Union[Hello, Done, Abort, Fail, Fence, Ping]


def _room(room: str) -> bytes:
    raw = room.encode()
    if len(raw) > 0xFFFF:
        raise ValueError(f"room id too long ({len(raw)} bytes)")
    return _U16.pack(len(raw)) + raw


def _blob(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def encode(msg: Message) -> bytes:
    if isinstance(msg, Hello):
        kind, body = Kind.HELLO, _blob(msg.info)
    elif isinstance(msg, Done):
        kind, body = Kind.DONE, _room(msg.room) + _blob(msg.payload)
    elif isinstance(msg, Abort):
        kind, body = Kind.ABORT, _room(msg.room)
    elif isinstance(msg, Fail):
        kind, body = Kind.FAIL, _room(msg.room) + _blob(msg.reason.encode())
    elif isinstance(msg, Fence):
        kind, body = Kind.FENCE, _room(msg.room)
    elif isinstance(msg, Ping):
        kind, body = Kind.PING, b""
    else:
        raise TypeError(f"not a transfer message: {msg!r}")
    return _HEADER.pack(MAGIC, VERSION, kind) + body


class _Reader:
    def __init__(self, data: bytes, pos: int):
        self.data, self.pos = data, pos

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise WireError("truncated message")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def room(self) -> str:
        (n,) = _U16.unpack(self.take(_U16.size))
        try:
            return self.take(n).decode()
        except UnicodeDecodeError as e:
            raise WireError("room id is not UTF-8") from e

    def blob(self) -> bytes:
        (n,) = _U32.unpack(self.take(_U32.size))
        return self.take(n)

    def end(self) -> None:
        if self.pos != len(self.data):
            raise WireError("trailing bytes")


def decode(data: bytes) -> Message:
    """Bytes -> message, or WireError (never another exception) for anything malformed."""
    if len(data) < _HEADER.size:
        raise WireError("short message")
    magic, version, kind = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError("not a pdserve transfer message")
    if version != VERSION:
        raise WireError(f"unsupported version {version}")
    r = _Reader(data, _HEADER.size)
    msg: Message
    if kind == Kind.HELLO:
        msg = Hello(r.blob())
    elif kind == Kind.DONE:
        msg = Done(r.room(), r.blob())
    elif kind == Kind.ABORT:
        msg = Abort(r.room())
    elif kind == Kind.FAIL:
        room, raw = r.room(), r.blob()
        msg = Fail(room, raw.decode(errors="replace"))
    elif kind == Kind.FENCE:
        msg = Fence(r.room())
    elif kind == Kind.PING:
        msg = Ping()
    else:
        raise WireError(f"unknown kind {kind}")
    r.end()
    return msg
