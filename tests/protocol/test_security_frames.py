"""Issue 14 in the sans-IO protocol: the 4 KiB handshake limit, decoding
limits, and MACed frames (changed, injected, dropped, replayed or reordered
frames are refused). No sockets."""

from __future__ import annotations

import os

import msgpack
import pytest

from p2pxfer.membership import ClusterAuth
from p2pxfer.protocol import (
    INITIATOR,
    RESPONDER,
    SCHEMA_VERSION,
    Connection,
    FrameDecoder,
    Message,
    RemoteProtocolError,
    encode_frame,
)
from p2pxfer.protocol._frames import HANDSHAKE_MAX_FRAME, MAC_BYTES, FrameMac


def _pair(protocol: str = "peer") -> tuple[Connection, Connection]:
    ini, rsp = Connection(protocol, INITIATOR), Connection(protocol, RESPONDER)
    role = "daemon" if protocol == "peer" else "client"
    rsp.receive_data(ini.send("hello", v=SCHEMA_VERSION, role=role))
    assert isinstance(rsp.next_event(), Message)
    ini.receive_data(rsp.send("welcome", v=SCHEMA_VERSION, node="b", incarnation=1,
                              max_frame=1 << 20))
    assert isinstance(ini.next_event(), Message)
    return ini, rsp


def test_handshake_frames_are_capped_until_the_caller_is_known() -> None:
    rsp = Connection("client", RESPONDER)
    big = encode_frame({"t": "hello", "v": SCHEMA_VERSION, "role": "client",
                        "name": "x" * HANDSHAKE_MAX_FRAME})
    rsp.receive_data(big[:4])
    with pytest.raises(RemoteProtocolError) as err:
        rsp.next_event()
    assert err.value.code == "too_big" and err.value.fatal
    ini, rsp = _pair("client")
    assert rsp.frame_limit == HANDSHAKE_MAX_FRAME
    assert ini.frame_limit == ini.max_frame  # the welcome lifted ours
    rsp.lift_frame_limit()
    rsp.receive_data(ini.send("status", id=1) + encode_frame(
        {"t": "unshare", "id": 2, "mem": 1, "pad": b"x" * 100_000}))
    assert rsp.next_event().kind == "status"  # type: ignore[union-attr]
    with pytest.raises(RemoteProtocolError) as err:
        rsp.next_event()
    assert err.value.code == "bad_request"  # read (the pad is an unknown field), not too_big


def test_a_responder_refuses_frames_of_many_containers() -> None:
    dec = FrameDecoder(1 << 24, max_containers=64)
    dec.feed(encode_frame({"t": "status", "id": 1, "pad": [{}] * 65}, 1 << 24))
    with pytest.raises(RemoteProtocolError, match="bad_frame"):
        dec.next_frame()
    body = msgpack.packb({"t": "status", "id": 1, "k": list(range(5000))})
    dec.feed(len(body).to_bytes(4, "big") + body)
    with pytest.raises(RemoteProtocolError, match="bad_frame"):
        dec.next_frame()
    dec.feed(encode_frame({"t": "status", "id": 1, "pad": [{}] * 10}))
    assert dec.next_frame() is not None
    unlimited = FrameDecoder(1 << 24)  # initiators read big results
    unlimited.feed(encode_frame({"regions": [{}] * 1000}, 1 << 24))
    assert len(unlimited.next_frame()["regions"]) == 1000  # type: ignore[index]


def _secured() -> tuple[Connection, Connection]:
    ini, rsp = _pair()
    auth = ClusterAuth(b"token")
    i2r, r2i = auth.session_keys(os.urandom(16), os.urandom(16), "a", "b")
    ini.secure(i2r, r2i)
    rsp.secure(r2i, i2r)
    return ini, rsp


def test_secured_frames_round_trip_and_carry_a_tag() -> None:
    ini, rsp = _secured()
    wire = ini.send("resolve", id=1, region="r")
    assert len(wire) == len(encode_frame({"t": "resolve", "id": 1, "region": "r"})) + MAC_BYTES
    rsp.receive_data(wire + ini.send("resolve", id=2, region="s"))
    assert [rsp.next_event().get("region") for _ in range(2)] == ["r", "s"]  # type: ignore[union-attr]
    ini.receive_data(rsp.send("ok", id=2) + rsp.send("ok", id=1))
    assert [ini.next_event().id for _ in range(2)] == [2, 1]  # type: ignore[union-attr]


@pytest.mark.parametrize("attack", ["unmaced", "flipped", "replayed", "reordered", "dropped",
                                    "other-key"])
def test_a_frame_not_from_the_key_holder_is_fatal(attack: str) -> None:
    ini, rsp = _secured()
    first = ini.send("resolve", id=1, region="r")
    second = ini.send("resolve", id=2, region="s")
    wire = {
        "unmaced": encode_frame({"t": "resolve", "id": 1, "region": "r"}),
        "flipped": first[:-1] + bytes([first[-1] ^ 1]),
        "replayed": first + first,
        "reordered": second + first,
        "dropped": second,
        "other-key": encode_frame({"t": "resolve", "id": 1, "region": "r"}, 1 << 20,
                                  FrameMac(b"k" * 32)),
    }[attack]
    rsp.receive_data(wire)
    if attack == "replayed":
        assert rsp.next_event().id == 1  # type: ignore[union-attr]
    with pytest.raises(RemoteProtocolError) as err:
        rsp.next_event()
    assert err.value.code == "auth_failed" and err.value.fatal


def test_session_keys_differ_per_connection_direction_and_token() -> None:
    a, b = ClusterAuth(b"t1"), ClusterAuth(b"t2")
    nc, nr = b"c" * 16, b"r" * 16
    keys = a.session_keys(nc, nr, "x", "y")
    assert keys[0] != keys[1]
    assert keys == a.session_keys(nc, nr, "x", "y")
    assert keys != b.session_keys(nc, nr, "x", "y")
    assert keys != a.session_keys(nr, nc, "x", "y")
    assert keys != a.session_keys(nc, nr, "y", "x")
    # no proof sent in the clear is a key
    assert a.connection_proof("initiator", nc, nr, "x") not in keys
    assert a.connection_proof("responder", nc, nr, "y") not in keys
