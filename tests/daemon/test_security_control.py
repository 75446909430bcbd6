"""Issue 14, the control port as an attacker on the same network sees it
(daemons on 127.0.0.1, scripts speaking the protocol by hand): credentials
required off loopback, frames MACed after ``auth``, peers learnt only from
token holders at their own address, bounded tables and connections, no
leaks in ``status``. Each test failed before the fix it names."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from daemon_helpers import RawControl
from p2pxfer.daemon import Daemon, DaemonConfig
from p2pxfer.daemon._daemon import check_exposure, raise_fd_limit
from p2pxfer.daemon._peers import PeerTable
from p2pxfer.errors import InvalidArgument
from p2pxfer.membership import ClusterAuth
from p2pxfer.protocol import encode_frame
from p2pxfer.protocol._frames import FrameMac
from p2pxfer.testing import LOOPBACK, DaemonProc, RawConn, free_port, start_daemon, wait_for

TOKEN = "security-test-token"


def RawPeer(address: str) -> RawControl:
    """Here a silent daemon counts as one that hung up."""
    return RawControl(address, silence_closes=True)


def _status(d: DaemonProc) -> dict[str, Any]:
    with RawConn(d.socket) as c:
        c.hello()
        reply = c.request({"t": "status", "id": 1})
    assert reply["t"] == "ok", reply
    return dict(reply["result"])


# -- 1. the default config is no longer open to the network ------------------------------

@pytest.mark.parametrize("keys", [
    {"control": "0.0.0.0:0", "fabric_node": LOOPBACK},
    {"control": f"{LOOPBACK}:0", "fabric_node": ""},  # tcp on every interface
    {"control": f"{LOOPBACK}:0", "fabric_node": "10.1.2.3"},
], ids=["control-any", "fabric-every-interface", "fabric-lan"])
def test_no_token_off_loopback_refuses_to_start(keys: dict[str, str]) -> None:
    cfg = DaemonConfig.from_dict({"node": "x", "provider": "tcp;ofi_rxm", **keys})
    with pytest.raises(InvalidArgument, match="cluster_token"):
        check_exposure(cfg)
    assert check_exposure(DaemonConfig.from_dict({"node": "x", "cluster_token": TOKEN,
                                                  **keys})) is False


def test_open_daemon_on_loopback_says_so(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    cfg = DaemonConfig.from_dict({"node": "x", "control": f"{LOOPBACK}:0",
                                  "fabric_node": LOOPBACK})
    assert check_exposure(cfg) is True
    assert check_exposure(DaemonConfig.from_dict({"node": "x", "provider": "shm"})) is True
    d = start_daemon(tmp_path, "open-a", control_port=free_port())
    daemons.append(d)
    assert _status(d)["security"].startswith("open:")
    assert "daemon.open" in d.log.read_text()


def test_daemon_off_loopback_without_token_exits(tmp_path: Path) -> None:
    from p2pxfer.testing import p2pxfer_cmd, write_config
    cfg = write_config(tmp_path / "exposed.toml", {
        "node": "exposed", "socket": str(tmp_path / "exposed.sock"),
        "control": f"0.0.0.0:{free_port()}", "fabric_node": LOOPBACK})
    run = subprocess.run([*p2pxfer_cmd(), "daemon", "--config", str(cfg)],
                         check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "cluster_token" in run.stdout + run.stderr
    assert not (tmp_path / "exposed.sock").exists()


def test_status_over_tcp_hides_regions_and_pids(tmp_path: Path,
                                                daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "leaky", control_port=free_port())
    daemons.append(d)
    with RawConn(d.socket) as c:
        c.hello()
        fd = os.memfd_create("secret", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4096)
        mem = c.request({"t": "share", "id": 1, "size": 4096}, fds=[fd])["result"]["mem"]
        os.close(fd)
        assert c.request({"t": "export", "id": 2, "name": "secret-region", "mem": mem,
                          "offset": 0, "length": 4096})["t"] == "ok"
        raw = RawPeer(d.control)
        raw.hello()
        reply = raw.request({"t": "status", "id": 1})
        raw.close()
        assert reply is not None and reply["t"] == "ok", reply
        assert reply["result"]["regions"] == []
        assert "secret-region" not in repr(reply) and "pid:" not in repr(reply)
        assert reply["result"]["security"].startswith("open")


# -- 2. peers are learnt only from authenticated callers, where they call from ----------

def test_unauthenticated_hellos_add_no_peers(tmp_path: Path,
                                            daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "open-b", control_port=free_port())
    daemons.append(d)
    for i in range(30):
        raw = RawPeer(d.control)
        raw.hello(f"evil-{i}", control=f"{LOOPBACK}:{20000 + i}")
        raw.close()
    time.sleep(0.2)
    assert _status(d)["peers"] == []


def test_token_holder_is_learnt_only_at_its_source(tmp_path: Path,
                                                  daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "tok-a", control_port=free_port(), cluster_token=TOKEN)
    daemons.append(d)
    auth = ClusterAuth(TOKEN.encode())
    # Calls from 127.0.0.1 but says it lives at 127.0.0.2: not learnt.
    raw = RawPeer(d.control)
    mine = os.urandom(16)
    welcome = raw.hello("liar", nonce=mine, control=f"127.0.0.2:{free_port()}")
    raw.send({"t": "auth", "id": 1, "proof": auth.connection_proof(
        "initiator", mine, welcome["nonce"], "liar")})
    send, receive = auth.session_keys(mine, welcome["nonce"], "liar", "tok-a")
    raw.send_mac, raw.decoder.mac = FrameMac(send), FrameMac(receive)
    assert (raw.frame() or {}).get("t") == "ok"
    raw.close()
    # One that tells the truth is.
    honest = RawPeer(d.control)
    honest.authenticate(auth, "honest", "tok-a")
    honest.close()
    names = wait_for(lambda: {p["name"] for p in _status(d)["peers"]} or None, "a peer")
    assert names == {"honest"}
    assert "peer.not_learnt" in d.log.read_text()


def test_log_throttle() -> None:
    from p2pxfer._pump import LogThrottle
    t = LogThrottle(1.0)
    assert t.due(10.0) == 0
    assert [t.due(10.0 + i / 10) for i in range(1, 5)] == [None] * 4
    assert t.due(11.5) == 4  # the next line says how many went unlogged


def test_peer_table_is_bounded() -> None:
    table = PeerTable("me", (), auth=None, max_frame=1 << 20, max_peers=3)
    for i in range(3):
        table.add(f"p{i}", f"{LOOPBACK}:{7000 + i}")
    table.add("p0", f"{LOOPBACK}:7100")  # replacing a known one is fine
    with pytest.raises(InvalidArgument, match="full"):
        table.add("p3", f"{LOOPBACK}:7003")
    assert len(table.names()) == 3


# -- with a token, frames after the handshake carry a MAC --------------------------------

@pytest.mark.parametrize("attack", ["plain", "tampered", "replayed"])
def test_injected_frames_after_auth_end_the_connection(tmp_path: Path, attack: str,
                                                       daemons: list[DaemonProc]) -> None:
    if not daemons:
        daemons.append(start_daemon(tmp_path, "mac-a", control_port=free_port(),
                                    cluster_token=TOKEN))
    d = daemons[0]
    raw = RawPeer(d.control)
    raw.authenticate(ClusterAuth(TOKEN.encode()), "mac-caller", "mac-a")
    good = encode_frame({"t": "resolve", "id": 2, "region": "x"}, 1 << 20, raw.send_mac)
    reply = raw.sock.sendall(good) or raw.frame()
    assert reply is not None and reply["code"] == "unknown_region", reply
    frame = encode_frame({"t": "status", "id": 3}, 1 << 20)  # what a proxy would inject
    if attack == "tampered":
        assert raw.send_mac is not None
        sealed = bytearray(encode_frame({"t": "status", "id": 3}, 1 << 20, raw.send_mac))
        sealed[10] ^= 1
        frame = bytes(sealed)
    elif attack == "replayed":
        frame = good
    raw.sock.sendall(frame)
    reply = raw.frame()  # the daemon's answer is MACed too
    if reply is not None:
        assert reply["t"] == "error" and reply.get("code") == "auth_failed", reply
        assert "status" not in reply.get("result", {})
    assert raw.frame() is None  # closed
    raw.close()
    assert d.alive()


# -- limits: frame size before auth, connections, half-open callers, fds ----------------

def test_pre_auth_frames_are_capped_at_4k(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "cap-a", control_port=free_port(), cluster_token=TOKEN)
    daemons.append(d)
    raw = RawPeer(d.control)
    raw.sock.sendall(struct.pack(">I", 16 << 20))  # 16 MiB promised, nothing sent
    reply = raw.frame()
    assert reply is not None and reply["code"] == "too_big" and "4096" in reply["message"]
    assert raw.frame() is None
    raw.close()
    with RawConn(d.socket) as c:  # the same goes for clients before hello
        c.send_raw(struct.pack(">I", 8192))
        reply = c.frame()
        assert reply is not None and reply["code"] == "too_big", reply


def test_connections_per_source_are_capped(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "conns", control_port=free_port(), max_connections_per_host=4)
    daemons.append(d)
    host, port = d.control.rsplit(":", 1)
    held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(4)]
    try:
        time.sleep(0.3)  # the daemon has accepted those four
        extra = socket.create_connection((host, int(port)), timeout=5)
        assert extra.recv(1) == b""  # closed unread
        extra.close()
        for _ in range(50):  # a flood: refused, and not a line each in the log
            flood = socket.create_connection((host, int(port)), timeout=5)
            assert flood.recv(1) == b""
            flood.close()
        refused = wait_for(lambda: d.log.read_text().count("peer.refused"), "a refusal")
        assert 1 <= refused <= 3, refused
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    raw = RawPeer(d.control)  # room again
    raw.hello()
    raw.close()


def test_a_silent_caller_is_cut_off_on_an_open_daemon(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """Without a token there is nothing to prove, but a caller that never says
    hello still holds a descriptor for AUTH_TIMEOUT_S at most."""
    from p2pxfer.daemon import _auth as auth_mod
    from p2pxfer.daemon._control import serve_peer

    monkeypatch.setattr(auth_mod, "AUTH_TIMEOUT_S", 0.3)
    engine: Any = SimpleNamespace(config=SimpleNamespace(incarnation=1))
    d = Daemon(DaemonConfig(node="node-a"), engine)

    async def main() -> None:
        ours, theirs = trio.socket.socketpair()
        caller = trio.SocketStream(theirs)
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_peer, d, trio.SocketStream(ours))
            with trio.fail_after(5):
                assert await caller.receive_some(1 << 16) == b""
        assert 0.3 <= trio.current_time() - t0 < 5
        await caller.aclose()

    trio.run(main)


def test_fd_limit_is_raised() -> None:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        got = raise_fd_limit()
        assert got == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert got > low or hard == low
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
