"""Issue 14, the unix socket and the machine the daemon runs on: descriptors
and memory a client can make the daemon hold, shared memory that shrinks
under a mapping (SIGBUS), clients of other uids, and the socket path. Each
test failed before the fix it names."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from daemon_helpers import as_uid
from p2pxfer.kv import KVLayout
from p2pxfer.memory import SharedBuffer
from p2pxfer.protocol import SCHEMA_VERSION, encode_frame, pack_scatter
from p2pxfer.soak import status_kib
from p2pxfer.testing import (
    LOOPBACK,
    DaemonProc,
    RawConn,
    free_port,
    p2pxfer_cmd,
    start_daemon,
    wait_for,
    write_config,
)

NOBODY = 65534


def _fds(d: DaemonProc) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def _rss_kib(d: DaemonProc) -> int:
    return status_kib(d.proc.pid, "VmRSS")


def _sealable(size: int) -> int:
    fd = os.memfd_create("sec", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    return fd


def _share(c: RawConn, rid: int, fd: int, size: int) -> dict[str, Any]:
    return c.request({"t": "share", "id": rid, "size": size}, fds=[fd])


def _shared_mem(c: RawConn, rid: int, size: int = 1 << 16) -> Any:
    """Share a fresh memfd of ``size`` bytes; the daemon's handle for it."""
    fd = _sealable(size)
    try:
        return _share(c, rid, fd, size)["result"]["mem"]
    finally:
        os.close(fd)


# -- descriptors and memory a client makes the daemon hold -----------------------------

def test_descriptors_sent_without_share_are_capped(tmp_path: Path,
                                                   daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "fds")
    daemons.append(d)
    base = _fds(d)
    mine = [_sealable(4096) for _ in range(8)]
    try:
        with RawConn(d.socket) as c:
            c.hello()
            for i in range(40):  # 320 descriptors, no share
                try:
                    c.send({"t": "status", "id": 10 + i}, fds=mine)
                except OSError:
                    break  # the daemon already hung up
            while c.frame() is not None:
                pass  # answers, then the end
        wait_for(lambda: "client.fd_flood" in d.log.read_text(), "the flood to be logged")
        deadline = time.monotonic() + 5
        while _fds(d) > base + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _fds(d) <= base + 2, (base, _fds(d))
    finally:
        for fd in mine:
            os.close(fd)
    with RawConn(d.socket) as c:  # eight at a time ahead of their shares are fine
        c.hello()
        ahead = [_sealable(4096) for _ in range(8)]
        c.send({"t": "status", "id": 1}, fds=ahead)
        for fd in ahead:
            os.close(fd)
        assert c.frame() is not None
        for i in range(8):
            assert c.request({"t": "share", "id": 2 + i, "size": 4096})["t"] == "ok"


def test_a_share_refused_for_its_fields_takes_its_descriptor_with_it(
        tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """The next share maps its own memfd, not the one a refused share sent."""
    d = start_daemon(tmp_path, "refusedshare")
    daemons.append(d)
    refused = os.memfd_create("refused")  # cannot be sealed: the daemon would refuse it
    good = _sealable(1 << 16)
    try:
        with RawConn(d.socket) as c:
            c.hello()
            reply = c.request({"t": "share", "id": 1, "size": "64KiB"}, fds=[refused])
            assert reply["t"] == "error" and reply["code"] == "bad_request", reply
            assert "size" in reply["message"], reply
            reply = _share(c, 2, good, 1 << 16)
            assert reply["t"] == "ok", reply  # it took `good`, not `refused`
            held = [os.readlink(f"/proc/{d.proc.pid}/fd/{n}")
                    for n in os.listdir(f"/proc/{d.proc.pid}/fd")]
            assert not [h for h in held if "memfd:refused" in h], held
    finally:
        os.close(refused)
        os.close(good)


def test_a_frame_of_empty_maps_is_refused_cheaply(tmp_path: Path,
                                                  daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "maps")
    daemons.append(d)
    n = (16 << 20) - 64
    head = b"\x83\xa1t\xa6status\xa2id\x01\xa3pad\xdd" + struct.pack(">I", n)
    body = head + b"\x80" * n  # {"t": "status", "id": 1, "pad": [{}, {}, ...]}
    before = _rss_kib(d)
    with RawConn(d.socket, timeout=20) as c:
        c.hello()
        t0 = time.monotonic()
        c.send_raw(struct.pack(">I", len(body)) + body)
        reply = c.frame()
        took = time.monotonic() - t0
    assert reply is not None and reply["code"] == "bad_frame", reply
    assert took < 10, took  # before: 7 s and 1.6 GB; the RSS check is the sharp one
    assert _rss_kib(d) - before < 200 << 10, (before, _rss_kib(d))
    assert d.alive()


def test_bad_frames_log_bounded_lines(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "loglines")
    daemons.append(d)
    size = d.log.stat().st_size
    with RawConn(d.socket) as c:
        c.hello()
        reply = c.request({"t": "x" * (1 << 20), "id": 1})
        assert reply["code"] == "unknown_type" and len(reply["message"]) < 1000
    with RawConn(d.socket) as c:
        c.hello()
        reply = c.request({"t": "status", "id": 1, **{f"k{i}" * 500: 1 for i in range(200)}})
        assert reply["code"] == "bad_request" and len(reply["message"]) < 1000
    time.sleep(0.2)
    assert d.log.stat().st_size - size < 64 << 10


# -- shared memory: only sealed memfds (no SIGBUS) ----------------------------------------

def test_shared_memory_cannot_shrink_under_the_daemon(tmp_path: Path,
                                                      daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "seals")
    daemons.append(d)
    buf = SharedBuffer(1 << 16)  # what clients allocate: sealed at birth
    with pytest.raises(PermissionError):
        os.ftruncate(buf.fd, 0)
    buf.close()
    with RawConn(d.socket) as c:
        c.hello()
        fd = _sealable(1 << 16)  # sealable, not sealed: the daemon seals it
        assert _share(c, 1, fd, 1 << 16)["t"] == "ok"
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # the attack: shrink, then have a peer write into it
        os.close(fd)
        # A memfd that cannot be sealed, a plain file, a pipe: refused.
        unsealable = os.memfd_create("nosealing")
        os.ftruncate(unsealable, 4096)
        with tempfile.TemporaryFile() as f:
            f.truncate(4096)
            r, w = os.pipe()
            for rid, bad in enumerate((unsealable, f.fileno(), r), start=2):
                reply = _share(c, rid, bad, 4096)
                assert reply["t"] == "error" and reply["code"] == "bad_request", reply
                assert "memfd" in reply["message"] or "seal" in reply["message"]
            os.close(r)
            os.close(w)
        os.close(unsealable)
    assert d.alive()


# -- local isolation between uids ----------------------------------------------------------



@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other uids can reach (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="p2pxfer-sec-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_other_uids_are_isolated(open_dir: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(open_dir, "iso", allowed_uids=[NOBODY])
    daemons.append(d)
    with RawConn(d.socket) as owner:
        owner.hello()
        mem = _shared_mem(owner, 1)
        assert owner.request({"t": "export", "id": 2, "name": "roots", "mem": mem,
                              "offset": 0, "length": 1 << 16})["t"] == "ok"

        def intruder() -> dict[str, Any]:
            with RawConn(d.socket) as c:
                c.hello()
                out = {"add_peer": c.request({"t": "add_peer", "id": 1, "name": "evil",
                                              "address": f"{LOOPBACK}:9"})["code"]}
                mem = _shared_mem(c, 2)
                scatter = pack_scatter(np.array([0]), np.array([0]), np.array([4096]))
                out["write"] = c.request({"t": "write", "id": 3, "peer": "iso",
                                          "region": "roots", "mem": mem, "offset": 0,
                                          "scatter": scatter})["code"]
                assert c.request({"t": "kv_pool", "id": 4, "name": "src", "mem": mem,
                                  "layout": layout, "receive": False})["t"] == "ok"
                one = np.array([0], dtype=np.int64).tobytes()
                out["kv_push"] = c.request({"t": "kv_push", "id": 5, "peer": "iso",
                                            "pool": "kvroots", "src": "src", "src_blocks": one,
                                            "dst_blocks": one, "request": 1})["code"]
                return out

        layout = KVLayout(1, 4, 4096).to_wire()
        kvmem = _shared_mem(owner, 7)
        assert owner.request({"t": "kv_pool", "id": 8, "name": "kvroots", "mem": kvmem,
                              "layout": layout})["t"] == "ok"
        assert as_uid(NOBODY, intruder) == {"add_peer": "forbidden",
                                             "write": "unknown_region",
                                             "kv_push": "unknown_region"}

        # The owner grants NOBODY this one region (``writers``): its writes
        # land there, and still nowhere else of the owner's.
        bad = owner.request({"t": "export", "id": 3, "name": "granted", "mem": mem,
                             "offset": 0, "length": 1 << 16, "writers": ["nobody"]})
        assert bad["code"] == "bad_request" and "writers" in bad["message"], bad
        assert owner.request({"t": "export", "id": 4, "name": "granted", "mem": mem,
                              "offset": 0, "length": 1 << 16, "writers": [NOBODY]})["t"] == "ok"

        def grantee() -> dict[str, Any]:
            with RawConn(d.socket) as c:
                c.hello()
                mem = _shared_mem(c, 2)
                scatter = pack_scatter(np.array([0]), np.array([0]), np.array([4096]))
                out = {}
                for i, region in enumerate(("granted", "roots")):
                    r = c.request({"t": "write", "id": 3 + i, "peer": "iso", "region": region,
                                   "mem": mem, "offset": 0, "scatter": scatter})
                    out[region] = r["t"] if r["t"] == "ok" else r["code"]
                return out

        assert as_uid(NOBODY, grantee) == {"granted": "ok", "roots": "unknown_region"}
        assert owner.request({"t": "unexport", "id": 5, "name": "granted"})["t"] == "ok"
        assert owner.request({"t": "export", "id": 6, "name": "granted", "mem": mem,
                              "offset": 0, "length": 1 << 16})["t"] == "ok"
        # the grant died with that export: a new one of the same name is the owner's alone
        assert as_uid(NOBODY, grantee)["granted"] == "unknown_region"

        def stranger() -> Any:
            with RawConn(d.socket) as c:
                try:
                    c.send({"t": "hello", "v": SCHEMA_VERSION, "role": "client"})
                except OSError:
                    return None  # closed before the hello went out
                return c.frame()

        assert as_uid(NOBODY - 1, stranger) is None  # not allowed: closed unanswered
    assert d.alive()


# -- the socket path -------------------------------------------------------------------------

def _run_daemon(tmp_path: Path, name: str, sock: Path) -> subprocess.CompletedProcess[str]:
    cfg = write_config(tmp_path / f"{name}.toml", {
        "node": name, "socket": str(sock), "control": f"{LOOPBACK}:{free_port()}",
        "fabric_node": LOOPBACK})
    return subprocess.run([*p2pxfer_cmd(), "daemon", "--config", str(cfg)],
                          check=False, capture_output=True, text=True, timeout=60)


def test_a_second_daemon_does_not_take_a_live_socket(tmp_path: Path,
                                                     daemons: list[DaemonProc]) -> None:
    a = start_daemon(tmp_path, "first")
    daemons.append(a)
    run = _run_daemon(tmp_path, "second", Path(a.socket))
    # Refused by the CLI's startup check or by the daemon itself, whichever sees it first.
    said = run.stdout + run.stderr
    assert run.returncode != 0, said
    assert "already listening" in said or "another daemon is listening" in said, said
    assert os.path.exists(a.socket)  # not removed on the way out either
    assert a.status()["node"] == "first"


def test_a_socket_path_on_a_regular_file_leaves_it_alone(tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    run = _run_daemon(tmp_path, "careless", victim)
    assert run.returncode != 0 and "not a socket" in run.stdout + run.stderr
    assert victim.read_text() == "keep me"


def test_a_stale_socket_is_replaced(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # nobody listens there any more
    d = start_daemon(tmp_path, "stale")
    daemons.append(d)
    assert d.status()["node"] == "stale"
    _ = encode_frame  # the raw frames above are this module's own


@pytest.mark.parametrize("capped", [True, False], ids=["default-caps", "no-caps"])
def test_half_open_connections_under_a_low_fd_limit(tmp_path: Path, capped: bool) -> None:
    """300 control connections that never speak, under a 256-descriptor limit.
    With the default caps the daemon closes all but 64 at once; without them
    it runs out of descriptors, waits that out, and serves again once they go."""
    from p2pxfer.testing import spawn_daemon
    keys: dict[str, Any] = {"node": "lowfd", "socket": str(tmp_path / "lowfd.sock"),
                            "control": f"{LOOPBACK}:{free_port()}", "fabric_node": LOOPBACK}
    if not capped:
        keys.update(max_connections=1000, max_connections_per_host=1000,
                    max_pending_connections=1000, max_pending_per_range=1000)
    d = spawn_daemon(tmp_path, keys, wrap=lambda cmd: ["prlimit", "--nofile=256:256", *cmd])
    held: list[socket.socket] = []
    try:
        base = _fds(d)
        host, port = d.control.rsplit(":", 1)
        held.extend(socket.create_connection((host, int(port)), timeout=5) for _ in range(300))
        if capped:
            time.sleep(1.0)
            assert _fds(d) <= base + 64 + 2, (base, _fds(d))
        else:
            wait_for(lambda: _fds(d) >= 250, "the daemon to run out of descriptors")
            time.sleep(0.5)
        assert d.alive(), d.log_tail()
        for s in held:
            s.close()
        held.clear()
        wait_for(lambda: d.status(timeout=5)["node"] == "lowfd", "the daemon to serve again",
                 timeout=20)
    finally:
        for s in held:
            s.close()
        d.stop()


def test_a_client_that_never_says_hello_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """It would hold a descriptor and one of max_clients slots for ever."""
    from types import SimpleNamespace

    import trio

    from p2pxfer.daemon import Daemon, DaemonConfig
    from p2pxfer.daemon import _sessions as sessions_mod

    monkeypatch.setattr(sessions_mod, "HELLO_TIMEOUT_S", 0.3)
    engine: Any = SimpleNamespace(config=SimpleNamespace(incarnation=1))
    d = Daemon(DaemonConfig(node="node-a"), engine)

    async def main() -> None:
        ours, theirs = trio.socket.socketpair()
        t0 = trio.current_time()
        session = sessions_mod.ClientSession(d, ours, pid=1, uid=os.getuid())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.run)
            with trio.fail_after(5):
                assert await theirs.recv(1 << 16) == b""
        assert 0.3 <= trio.current_time() - t0 < 5
        theirs.close()

    trio.run(main)


def test_a_name_held_by_a_client_that_hung_up_is_taken_over(tmp_path: Path,
                                                             daemons: list[DaemonProc]) -> None:
    """A client exports a name right after the client that held it closed
    its socket, before the daemon has released its 64 exports: the export
    waits for that release instead of answering ``name_taken`` (it did, now
    and then, to a client replacing another)."""
    d = start_daemon(tmp_path, "handover")
    daemons.append(d)
    with RawConn(d.socket) as second:
        second.hello()
        mem2 = _shared_mem(second, 1)
        first = RawConn(d.socket)
        first.hello()
        mem1 = _shared_mem(first, 1)
        for i in range(64):
            assert first.request({"t": "export", "id": 2 + i, "name": f"held-{i}", "mem": mem1,
                                  "offset": 0, "length": 4096})["t"] == "ok"
        first.close()
        for i, name in enumerate(("held-63", "held-62")):
            reply = second.request({"t": "export", "id": 2 + i, "name": name, "mem": mem2,
                                    "offset": 0, "length": 4096})
            assert reply["t"] == "ok", reply
    assert d.alive()


# -- what one client's requests may make the daemon hold or do ----------------------------

def test_hostile_names_deadlines_and_push_sizes_are_refused_by_name(
        tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """A region name of megabytes (every status reply would carry it, every
    log line too), a KV push that would hold a receiving slot of the node's
    few for ever, and one whose pieces would take the event loop and
    gigabytes to expand: each refused with an error naming it, while
    another client is served throughout; an id-less ``error`` from a client
    ends its connection quietly, not as a crash."""
    d = start_daemon(tmp_path, "hostile")
    daemons.append(d)
    with RawConn(d.socket) as other:
        other.hello()

        def one(req: dict[str, Any], mem_size: int = 1 << 16) -> dict[str, Any]:
            with RawConn(d.socket, timeout=20) as c:
                c.hello()
                mem = _shared_mem(c, 1, mem_size)
                return c.request({**req, "mem": mem} if "mem" in req else req)

        r = one({"t": "export", "id": 2, "name": "x" * 300, "mem": 0, "offset": 0,
                 "length": 4096})
        assert r["code"] == "bad_request" and "'name' is 300 characters" in r["message"], r
        r = one({"t": "write", "id": 2, "peer": "hostile", "region": "r" * (1 << 20),
                 "mem": 0, "offset": 0, "scatter": pack_scatter(*[np.array([0])] * 3)})
        assert r["code"] == "bad_request" and "'region'" in r["message"], r
        assert len(r["message"]) < 1000

        with RawConn(d.socket, timeout=20) as c:
            c.hello()
            blocks = 1 << 17  # 64 layers x 131072 one-byte blocks: 8.4M pieces
            mem = _shared_mem(c, 1, 64 * blocks)
            lay = KVLayout(64, blocks, 1).to_wire()
            for rid, name, receive in ((2, "src", False), (3, "dst", True)):
                assert c.request({"t": "kv_pool", "id": rid, "name": name, "mem": mem,
                                  "layout": lay, "receive": receive})["t"] == "ok"
            every = np.arange(blocks, dtype=np.int64).tobytes()
            push = {"t": "kv_push", "peer": "hostile", "pool": "dst", "src": "src",
                    "src_blocks": every, "dst_blocks": every, "request": 1}
            t0 = time.monotonic()
            r = c.request({**push, "id": 4})
            assert r["code"] == "bad_request" and "8388608 pieces" in r["message"], r
            assert time.monotonic() - t0 < 5
            one_block = np.array([0], dtype=np.int64).tobytes()
            r = c.request({**push, "id": 5, "src_blocks": one_block, "dst_blocks": one_block,
                           "deadline_ms": 1 << 40})
            assert r["code"] == "bad_request" and "deadline_ms" in r["message"], r
            assert other.request({"t": "status", "id": 1})["t"] == "ok"

        with RawConn(d.socket) as c:
            c.hello()
            c.send({"t": "error", "code": "x", "message": "y" * 1000})
            assert c.frame() is None  # closed, unanswered
        assert other.request({"t": "status", "id": 2})["t"] == "ok"
    said = d.log.read_text()
    assert "client.error_received" in said and "request.crashed" not in said, d.log_tail()
    assert d.alive()
