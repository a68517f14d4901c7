"""The notification encoding: round trips, a pinned byte layout, and garbage rejected."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.transfer.wire import (Abort, Done, Fail, Fence, Hello, Ping, WireError, decode,
                                   encode)

pytestmark = pytest.mark.timeout(60)

rooms = st.text(min_size=0, max_size=64)
messages = st.one_of(
    st.builds(Hello, st.binary(max_size=2048)),
    st.builds(Done, rooms, st.binary(max_size=64)),
    st.builds(Abort, rooms),
    st.builds(Fail, rooms, st.text(max_size=64)),
    st.builds(Fence, rooms),
    st.just(Ping()),
)


@given(messages)
def test_every_message_round_trips(msg) -> None:
    assert decode(encode(msg)) == msg


def test_the_byte_layout_is_pinned() -> None:
    # magic "PD", version 1, kind 2 (DONE), room u16 len + utf8, payload u32 len + bytes
    assert encode(Done("r7", b"\x2a")) == b"PD\x01\x02\x00\x02r7\x00\x00\x00\x01\x2a"
    assert encode(Abort("r")) == b"PD\x01\x03\x00\x01r"
    assert encode(Ping()) == b"PD\x01\x06"


@pytest.mark.parametrize("raw", [
    b"", b"PD", b"XX\x01\x03\x00\x01r", b"PD\x02\x03\x00\x01r", b"PD\x01\x09",
    b"PD\x01\x03\x00\x05r", b"PD\x01\x03\x00\x01rr", b"PD\x01\x03\x00\x01\xff",
])
def test_malformed_bytes_raise_wire_error_only(raw: bytes) -> None:
    with pytest.raises(WireError):
        decode(raw)


@given(st.binary(max_size=64))
def test_random_bytes_never_raise_anything_but_wire_error(raw: bytes) -> None:
    try:
        decode(raw)
    except WireError:
        pass
