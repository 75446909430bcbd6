"""Issue 24: isolation against a hostile local user and a hostile key holder.

Real daemons in their own processes (tcp on loopback); a second local uid is
a forked child under ``nobody`` (``as_uid``), as in ``test_security_local``.
Each test failed before the fix it names.
"""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import trio

from daemon_helpers import RawControl, as_uid, daemon_pair, shared_mem
from p2pxfer.engine import EngineConfig, open_engine
from p2pxfer.kv import KVLayout
from p2pxfer.membership import ClusterAuth
from p2pxfer.memory import RegionDescriptor
from p2pxfer.protocol import SCHEMA_VERSION, FrameDecoder, encode_frame, pack_scatter
from p2pxfer.scatter import ScatterList
from p2pxfer.soak import status_kib
from p2pxfer.testing import (
    LOOPBACK,
    DaemonProc,
    RawConn,
    free_port,
    spawn_daemon,
    start_daemon,
)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (scheduling delays on a
    busy machine do not count)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



# -- finding 1: immediates that cannot be forged across sessions ---------------------------

async def _forge(descriptor: dict[str, Any], imms: list[int]) -> None:
    """One byte into a region we hold the key of, once per immediate, from
    an engine of our own (not through any daemon)."""
    async with open_engine(EngineConfig(provider="tcp;ofi_rxm", node=LOOPBACK)) as engine:
        src = np.zeros(4096, dtype=np.uint8)
        engine.register(src)
        desc = RegionDescriptor.from_wire(descriptor)
        for imm in imms:
            await engine.write(src, desc, ScatterList.contiguous(1), imm=imm, timeout=10)


def test_a_key_holder_cannot_forge_another_regions_immediates(
        tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """A client exports a region of its own and writes into it with its own
    libfabric endpoint, its CQ data naming other slots. Before: the owner's
    daemon routed the arrival by its slot bits alone, and the victim's
    ``wait_imm(7, region=...)`` returned though no byte reached it."""
    d = start_daemon(tmp_path, "forge", control_port=free_port(), cluster_token=TOKEN)
    daemons.append(d)
    with RawConn(d.socket, timeout=30) as victim, RawConn(d.socket, timeout=30) as attacker:
        victim.hello()
        attacker.hello()
        assert victim.request({"t": "export", "id": 2, "name": "victim",
                               "mem": shared_mem(victim, 1), "offset": 0,
                               "length": 4096})["t"] == "ok"
        atk = attacker.request({"t": "export", "id": 2, "name": "atk",
                                "mem": shared_mem(attacker, 1), "offset": 0,
                                "length": 4096})["result"]["descriptor"]
        bits = d.status()["imm_bits"]
        assert bits == 64
        # Slots go round-robin from 1: the victim's is 1, ours 2. Every way
        # we could lay out "slot 1, value 7" without knowing its tag.
        forged = [slot << (bits - 12) | 7 for slot in range(1, 9)]
        forged += [slot << 52 | tag << 20 | 7 for slot in (1, 2) for tag in (0, 1, 2)]
        trio.run(_forge, atk, forged)
        victim.send({"t": "wait_imm", "id": 3, "imm": 7, "count": 1, "region": "victim"})
        victim.sock.settimeout(3)  # only this answer is meant never to come
        with pytest.raises(TimeoutError):
            victim.frame()  # nothing landed in 'victim': its wait must not return
        assert d.status()["imms_dropped"] >= len(forged)
    assert d.alive()

# -- finding 2: waiters withdrawn and served in O(1), and bounded per client ---------------

def _leave_waiters(d: DaemonProc, n: int) -> float:
    """A client leaves ``n`` ``wait_imm`` calls waiting on one value and hangs
    up; a new client says hello and waits until the daemon has let the old one
    go. The daemon's CPU seconds from the hang-up to then."""
    with RawConn(d.socket, timeout=120) as c:
        c.hello()
        c.send_raw(b"".join(encode_frame({"t": "wait_imm", "id": 2 + i, "imm": 7, "count": 1})
                            for i in range(n)))
        assert c.request({"t": "status", "id": 1})["t"] == "ok"  # every one was read
        cpu0 = _cpu_s(d.proc.pid)
    with RawConn(d.socket, timeout=120) as fresh:
        fresh.hello()
        rid = 1
        while fresh.request({"t": "status", "id": rid})["result"]["clients"] != 1:
            rid += 1
            time.sleep(0.02)
    return _cpu_s(d.proc.pid) - cpu0


def test_cancelled_waiters_of_a_client_that_left_are_cheap(
        tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "waiters", max_waiters_per_client=100_000,
                     max_requests_per_client=100_000)
    daemons.append(d)
    small, large = _leave_waiters(d, 4_000), _leave_waiters(d, 40_000)
    # Ten times the waiters: linear is about ten times the daemon's CPU time,
    # quadratic a hundred (list.remove per waiter: 12 s of CPU for 20,000,
    # every client and the control port frozen meanwhile).
    assert large < 25 * max(small, 0.05), (small, large)
    assert d.alive()


def test_waiters_per_client_are_capped(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "capped", max_waiters_per_client=8)
    daemons.append(d)
    for _ in range(2):  # the cap is the client's: a new client has it whole again
        with RawConn(d.socket) as c:
            c.hello()
            for i in range(9):
                c.send({"t": "wait_imm", "id": 10 + i, "imm": 7, "count": 1})
            reply: dict[str, Any] | None = c.frame()  # one of the nine: the others wait
            assert reply is not None and reply["t"] == "error", reply
            assert reply["code"] == "limit" and "limit 8" in reply["message"], reply
    assert d.alive()


# -- finding 3: one uid check on every path into a region -------------------------------

NOBODY = 65534


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other uids can reach (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="p2pxfer-iso-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
@pytest.mark.parametrize("local_copy", [False, True], ids=["engine", "local-copy"])
def test_a_peer_alias_of_this_daemon_does_not_bypass_the_uid_check(
        open_dir: Path, daemons: list[DaemonProc], local_copy: bool) -> None:
    """A configured peer whose address is this daemon's own control port:
    writes and KV pushes through it reach this daemon's regions, and must
    meet the same uid check as those naming this node (before: with
    ``local_copy = false`` both landed in root's memory)."""
    port = free_port()
    d = start_daemon(open_dir, "iso", control_port=port, allowed_uids=[NOBODY],
                     local_copy=local_copy,
                     peers=[{"name": "mirror", "address": f"{LOOPBACK}:{port}"}])
    daemons.append(d)
    layout = KVLayout(1, 4, 4096).to_wire()
    with RawConn(d.socket) as owner:
        owner.hello()
        mem = shared_mem(owner, 1)
        assert owner.request({"t": "export", "id": 2, "name": "roots", "mem": mem,
                              "offset": 0, "length": 1 << 16})["t"] == "ok"
        kvmem = shared_mem(owner, 3)
        assert owner.request({"t": "kv_pool", "id": 4, "name": "kvroots", "mem": kvmem,
                              "layout": layout})["t"] == "ok"

        def intruder() -> dict[str, Any]:
            with RawConn(d.socket, timeout=30) as c:
                c.hello()
                mine = shared_mem(c, 2)
                scatter = pack_scatter(np.array([0]), np.array([0]), np.array([4096]))
                out = {}
                for peer in ("iso", "mirror"):
                    r = c.request({"t": "write", "id": 3, "peer": peer, "region": "roots",
                                   "mem": mine, "offset": 0, "scatter": scatter})
                    out[f"write {peer}"] = r.get("code", r["t"])
                assert c.request({"t": "kv_pool", "id": 4, "name": "src", "mem": mine,
                                  "layout": layout, "receive": False})["t"] == "ok"
                one = np.array([0], dtype=np.int64).tobytes()
                for peer in ("iso", "mirror"):
                    r = c.request({"t": "kv_push", "id": 5, "peer": peer, "pool": "kvroots",
                                   "src": "src", "src_blocks": one, "dst_blocks": one,
                                   "request": 1})
                    out[f"kv_push {peer}"] = r.get("code", r["t"])
                return out

        assert as_uid(NOBODY, intruder) == {
            "write iso": "unknown_region", "write mirror": "unknown_region",
            "kv_push iso": "unknown_region", "kv_push mirror": "unknown_region"}
        # The owner's own writes through the alias still work.
        scatter = pack_scatter(np.array([0]), np.array([4096]), np.array([4096]))
        assert owner.request({"t": "write", "id": 5, "peer": "mirror", "region": "roots",
                              "mem": mem, "offset": 0, "scatter": scatter},
                             )["t"] == "ok"
    assert d.alive()


# -- finding 4: region names scoped by uid ------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_uid_cannot_take_another_uids_region_name(open_dir: Path,
                                                   daemons: list[DaemonProc]) -> None:
    """Before: the second uid exported ``kv`` before root's service (or in
    the gap while it reconnected) and received the remote writes meant for
    root; root got ``name_taken``."""
    d = start_daemon(open_dir, "names", allowed_uids=[NOBODY])
    daemons.append(d)
    layout = KVLayout(1, 4, 4096).to_wire()
    mine = f"~{NOBODY}/kv"

    def squatter() -> dict[str, Any]:
        with RawConn(d.socket) as c:
            c.hello()
            mem = shared_mem(c, 1)
            out = {}
            for i, name in enumerate(("kv", "~0/kv", f"~{NOBODY}x/kv", mine)):
                r = c.request({"t": "export", "id": 2 + i, "name": name, "mem": mem,
                               "offset": 0, "length": 4096})
                out[name] = r.get("code", r["t"])
            r = c.request({"t": "kv_pool", "id": 9, "name": "kvpool", "mem": mem,
                           "layout": layout})
            out["kv_pool kvpool"] = r.get("code", r["t"])
            return out

    assert as_uid(NOBODY, squatter) == {"kv": "forbidden", "~0/kv": "forbidden",
                                        f"~{NOBODY}x/kv": "forbidden", mine: "ok",
                                        "kv_pool kvpool": "forbidden"}
    with RawConn(d.socket) as root:
        root.hello()
        mem = shared_mem(root, 1)
        for i, name in enumerate(("kv", "~0/kv")):
            assert root.request({"t": "export", "id": 2 + i, "name": name, "mem": mem,
                                 "offset": 0, "length": 4096})["t"] == "ok", name
        # Another uid's namespace is its own, root's included.
        r = root.request({"t": "export", "id": 5, "name": f"~{NOBODY}/other", "mem": mem,
                          "offset": 0, "length": 4096})
        assert r.get("code") == "forbidden" and f"~{NOBODY}/" in r["message"], r
    # Root's service is gone (reconnecting): its name is still not the other uid's.
    assert as_uid(NOBODY, squatter)["kv"] == "forbidden"
    assert d.alive()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
@pytest.mark.parametrize("local_copy", [False, True], ids=["engine", "local-copy"])
def test_why_a_region_was_withdrawn_is_told_only_to_uids_it_admitted(
        open_dir: Path, daemons: list[DaemonProc], local_copy: bool) -> None:
    """A region unexported with a reason: a later writer of a uid it did not
    admit hears ``unknown_region`` as for any name, not the reason; one it
    granted (``writers``) hears ``region_withdrawn`` and why. Through a peer
    entry whose address is this daemon's own, neither hears the reason (the
    uid is not known where the name is resolved)."""
    port = free_port()
    d = start_daemon(open_dir, "tomb", allowed_uids=[NOBODY], local_copy=local_copy,
                     control_port=port,
                     peers=[{"name": "mirror", "address": f"{LOOPBACK}:{port}"}])
    daemons.append(d)
    with RawConn(d.socket) as owner:
        owner.hello()
        mem = shared_mem(owner, 1)
        for i, (name, writers) in enumerate((("roots", []), ("granted", [NOBODY]))):
            assert owner.request({"t": "export", "id": 2 + i, "name": name, "mem": mem,
                                  "offset": 0, "length": 4096, "writers": writers}
                                 )["t"] == "ok"
            assert owner.request({"t": "unexport", "id": 4 + i, "name": name,
                                  "reason": "secret plans"})["t"] == "ok"

    def writer() -> dict[str, Any]:
        with RawConn(d.socket, timeout=30) as c:
            c.hello()
            mine = shared_mem(c, 1)
            scatter = pack_scatter(np.array([0]), np.array([0]), np.array([4096]))
            out = {}
            for i, (peer, region) in enumerate((("tomb", "roots"), ("tomb", "granted"),
                                                ("mirror", "roots"), ("mirror", "granted"))):
                r = c.request({"t": "write", "id": 2 + i, "peer": peer, "region": region,
                               "mem": mine, "offset": 0, "scatter": scatter})
                out[f"{peer} {region}"] = (r.get("code", r["t"]),
                                           "secret plans" in r.get("message", ""))
            return out

    assert as_uid(NOBODY, writer) == {
        "tomb roots": ("unknown_region", False), "tomb granted": ("region_withdrawn", True),
        "mirror roots": ("unknown_region", False), "mirror granted": ("unknown_region", False)}
    assert d.alive()


# -- finding 6: caps per client and per uid, each refusal a named ``limit`` ------------------

def _code(reply: dict[str, Any] | None) -> str:
    assert reply is not None
    return reply["t"] if reply["t"] != "error" else f"{reply['code']}: {reply['message']}"


#: the caps test's client_idle_s: long enough that its clients, silent
#: between their first requests on a starved CPU (another client's
#: requests come in between), are not closed as idle. With 1 s the child
#: raised in a busy fresh-clone run (what it raised was not shown then; the
#: test now shows it), and idling out is the one timing in its steps.
IDLE_S = 4.0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_per_client_and_per_uid_caps(open_dir: Path, daemons: list[DaemonProc]) -> None:
    """Before: no cap but max_clients (one uid's 256 idle clients locked root
    out; 150k requests grew the daemon by 1.5 GiB; 63 sparse memfds took its
    address space; 4095 exports took every immediate slot: ``internal``)."""
    mib = 1 << 20
    d = start_daemon(open_dir, "caps", allowed_uids=[NOBODY], max_clients_per_uid=2,
                     max_requests_per_client=4, max_requests_per_uid=6,
                     max_mapped_per_client=mib + mib // 16, max_mapped_per_uid=3 * mib // 2,
                     max_exports_per_client=2, max_exports_per_uid=3,
                         client_idle_s=IDLE_S)
    daemons.append(d)
    ns = f"~{NOBODY}/"

    def export(c: RawConn, rid: int, mem: int, name: str) -> str:
        return _code(c.request({"t": "export", "id": rid, "name": ns + name, "mem": mem,
                                "offset": 0, "length": 4096}))

    def wait(c: RawConn, rid: int) -> str:
        return _code(c.request({"t": "wait_imm", "id": rid, "imm": 1, "count": 1}))

    def user() -> dict[str, Any]:
        out: dict[str, Any] = {}
        with RawConn(d.socket) as c1, RawConn(d.socket) as c2:
            c1.hello()
            c2.hello()
            with RawConn(d.socket) as c3:  # a third client of this uid
                c3.send({"t": "hello", "v": SCHEMA_VERSION, "role": "client"})
                out["third client"] = _code(c3.frame())
            m1 = shared_mem(c1, 1, mib)
            fd = os.memfd_create("caps", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, mib)
            out["c1 more memory"] = _code(c1.request({"t": "share", "id": 2,
                                                      "size": mib // 8}, fds=[fd]))
            out["c2 1 MiB"] = _code(c2.request({"t": "share", "id": 3, "size": mib},
                                               fds=[fd]))
            os.close(fd)
            m2 = shared_mem(c2, 4, mib // 4)
            out["exports"] = [export(c1, 10, m1, "a"), export(c1, 11, m1, "b"),
                              export(c1, 12, m1, "c"), export(c2, 13, m2, "d"),
                              export(c2, 14, m2, "e")]
            for i in range(4):
                c1.send({"t": "wait_imm", "id": 20 + i, "imm": 1, "count": 1})
            out["c1 5th request"] = wait(c1, 24)
            for i in range(2):
                c2.send({"t": "wait_imm", "id": 30 + i, "imm": 1, "count": 1})
            out["c2 3rd request"] = wait(c2, 32)
            # At its cap a client can still cancel what it started.
            c1.send({"t": "cancel", "id": 25, "target": 20})
            out["cancel"] = sorted(_code(c1.frame()) for _ in range(2))
            c1.close()  # what it held comes back
            deadline = time.monotonic() + 10
            while (got := export(c2, 40, m2, "e")).startswith("limit") \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            out["c2 export after c1 left"] = got
            out["c2 request after c1 left"] = _code(c2.request({"t": "status", "id": 41}))
            c2.send({"t": "wait_imm", "id": 42, "imm": 1, "count": 1})
            c2.send({"t": "wait_imm", "id": 43, "imm": 1, "count": 1})
            out["c2 more waits"] = wait(c2, 44)  # its own cap of 4 now
        with RawConn(d.socket, timeout=IDLE_S + 6) as idle:
            idle.hello()
            t0 = time.monotonic()
            out["idle closed"] = idle.closed_by_peer()
            out["idle after"] = time.monotonic() - t0
        return out

    out = as_uid(NOBODY, user)
    assert isinstance(out, dict), out  # else what the child raised
    assert IDLE_S - 0.5 < out.pop("idle after") < IDLE_S + 3.5
    assert out["third client"].startswith("limit") and "max_clients_per_uid 2" \
        in out["third client"], out
    assert "max_mapped_per_client" in out["c1 more memory"], out
    assert "max_mapped_per_uid" in out["c2 1 MiB"], out
    exports = out.pop("exports")
    assert exports[:2] == ["ok", "ok"] and exports[3] == "ok", exports
    assert "max_exports_per_client" in exports[2] and "max_exports_per_uid" in exports[4]
    assert "max_requests_per_client" in out["c1 5th request"], out
    assert "max_requests_per_uid" in out["c2 3rd request"], out
    assert out["cancel"] == ["ok", "ok"], out  # the wait's answer (cancelled) and its own
    assert out["c2 export after c1 left"] == "ok", out
    assert out["c2 request after c1 left"] == "ok", out
    assert "max_requests_per_client" in out["c2 more waits"], out
    assert out["idle closed"] is True, out
    # Root's own service is not held to any uid's caps, and never idles out.
    with RawConn(d.socket) as root:
        root.hello()
        time.sleep(1.5)
        assert _code(root.request({"t": "status", "id": 1})) == "ok"
    assert d.alive()



# -- finding 5: no byte lands after unexport ------------------------------------------------

def test_no_byte_lands_in_the_owners_memory_after_unexport(tmp_path: Path) -> None:
    """A peer writes 32 MiB again and again into a region over tcp; its owner
    unexports it, zeroes its memory (which it goes on using) and looks again
    later. Before: up to 10 MB of it changed after ``unexport`` answered, in
    most rounds (the range was retired only when the memory was released)."""
    size = 32 << 20
    with daemon_pair(tmp_path) as (a, b), RawConn(b.socket, timeout=60) as owner, \
            RawConn(a.socket, timeout=60) as writer:
        owner.hello()
        writer.hello()
        fd = os.memfd_create("late", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        mine = mmap.mmap(fd, size)
        try:
            mem = owner.request({"t": "share", "id": 1, "size": size},
                                fds=[fd])["result"]["mem"]
            wfd = os.memfd_create("src", os.MFD_ALLOW_SEALING)
            os.ftruncate(wfd, size)
            os.pwrite(wfd, b"\xab" * size, 0)
            wmem = writer.request({"t": "share", "id": 1, "size": size},
                                  fds=[wfd])["result"]["mem"]
            os.close(wfd)
            scatter = pack_scatter(np.array([0]), np.array([0]), np.array([size]))
            dirty = []
            for rnd in range(4):
                assert owner.request({"t": "export", "id": 10 + rnd, "name": "late",
                                      "mem": mem, "offset": 0, "length": size})["t"] == "ok"
                mine[:] = bytes(size)
                wrote = threading.Event()

                def write_until_refused(rnd: int = rnd, wrote: threading.Event = wrote) -> None:
                    for i in range(1000):
                        r = writer.request({"t": "write", "id": 1000 * (rnd + 1) + i,
                                            "peer": "node-b", "region": "late", "mem": wmem,
                                            "offset": 0, "scatter": scatter})
                        if r["t"] != "ok":
                            return
                        wrote.set()

                loop = threading.Thread(target=write_until_refused)
                loop.start()
                assert wrote.wait(30), "no write landed"
                assert owner.request({"t": "unexport", "id": 20 + rnd, "name": "late"},
                                     )["t"] == "ok"
                mine[:] = bytes(size)  # the owner's memory is its own again
                loop.join(60)
                time.sleep(0.3)  # anything still streaming in has landed by now
                changed = np.count_nonzero(np.frombuffer(mine, dtype=np.uint8))
                dirty.append(changed)
            assert dirty == [0] * len(dirty), dirty
        finally:
            mine.close()
            os.close(fd)
        assert a.alive() and b.alive()

# -- finding 7: the control port against outsiders --------------------------------------

TOKEN = "isolation-test-token"


def _half_open(control: str, sources: list[str], n: int) -> list[socket.socket]:
    """``n`` connections that never say anything, from these source addresses
    in turn (all of them loopback: one range)."""
    host, port = control.rsplit(":", 1)
    held = []
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((sources[i % len(sources)], 0))
        s.settimeout(5)
        s.connect((host, int(port)))
        held.append(s)
    return held


def test_half_open_connections_cannot_keep_an_authenticated_peer_out(
        tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """Before: half-open connections from 127.0.0.2-6 held every control
    slot, and the real peer got none (its hello went unanswered)."""
    d = start_daemon(tmp_path, "ctl", control_port=free_port(), cluster_token=TOKEN,
                     max_connections=32)
    daemons.append(d)
    with RawConn(d.socket) as owner:
        owner.hello()
        mem = shared_mem(owner, 1)
        assert owner.request({"t": "export", "id": 2, "name": "roots", "mem": mem,
                              "offset": 0, "length": 4096})["t"] == "ok"
        sources = [f"127.0.0.{i}" for i in range(2, 7)]
        held = _half_open(d.control, sources, 40)
        try:
            time.sleep(0.3)  # accepted (or refused)
            auth = ClusterAuth(TOKEN.encode())
            peer = RawControl(d.control, silence_closes=True)
            peer.authenticate(auth, "honest", "ctl")
            reply = peer.request({"t": "resolve", "id": 2, "region": "roots"})
            assert reply is not None and reply["t"] == "ok", reply
            # Once authenticated it keeps its slot, whatever the flood does next.
            held += _half_open(d.control, sources, 100)
            time.sleep(0.3)
            for i in range(5):
                reply = peer.request({"t": "resolve", "id": 3 + i, "region": "roots"})
                assert reply is not None and reply["t"] == "ok", reply
            assert d.alive()
            assert "peer.evicted" in d.log.read_text()
        finally:
            for s in held:
                s.close()


def test_a_peers_answer_is_decoded_under_limits(tmp_path: Path,
                                                daemons: list[DaemonProc]) -> None:
    """Before: a configured peer answering ``resolve`` with 16M empty arrays
    grew the dialling daemon by about 1.2 GiB."""
    listener = socket.create_server((LOOPBACK, 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def evil_peer() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10)
                decoder = FrameDecoder(1 << 20)
                try:
                    while (data := conn.recv(1 << 16)):
                        decoder.feed(data)
                        while (msg := decoder.next_frame()) is not None:
                            if msg["t"] == "hello":
                                conn.sendall(encode_frame({
                                    "t": "welcome", "v": SCHEMA_VERSION, "node": "evil",
                                    "incarnation": 1, "max_frame": 16 << 20}))
                            elif msg.get("id") is not None:
                                conn.sendall(_empty_arrays_answer(msg["id"]))
                except OSError:
                    pass

    thread = threading.Thread(target=evil_peer, daemon=True)
    thread.start()
    try:
        d = start_daemon(tmp_path, "dialler",
                         peers=[{"name": "evil", "address": f"{LOOPBACK}:{port}"}])
        daemons.append(d)
        before = _hwm_kib(d)
        with RawConn(d.socket, timeout=60) as c:
            c.hello()
            mem = shared_mem(c, 1)
            scatter = pack_scatter(np.array([0]), np.array([0]), np.array([4096]))
            reply = c.request({"t": "write", "id": 2, "peer": "evil", "region": "x",
                               "mem": mem, "offset": 0, "scatter": scatter})
        assert reply["t"] == "error" and reply["code"] == "peer_unreachable", reply
        assert _hwm_kib(d) - before < 200 << 10, (before, _hwm_kib(d))
        assert d.alive()
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def _empty_arrays_answer(rid: int) -> bytes:
    n = (16 << 20) - 64
    body = (b"\x83" + msgpack.packb("t") + msgpack.packb("ok") + msgpack.packb("id")
            + msgpack.packb(rid) + msgpack.packb("result") + b"\x81"
            + msgpack.packb("descriptor") + b"\xdd" + struct.pack(">I", n) + b"\x90" * n)
    return struct.pack(">I", len(body)) + body


def _hwm_kib(d: DaemonProc) -> int:
    """The daemon's peak resident memory so far."""
    return status_kib(d.proc.pid, "VmHWM")


def test_metrics_connections_are_capped(tmp_path: Path) -> None:
    """Before: every silent connection to an open metrics port was accepted
    and held, until the descriptors ran out; then trio logged a traceback
    per failed accept, unthrottled."""
    keys: dict[str, Any] = {"node": "metrics", "socket": str(tmp_path / "metrics.sock"),
                            "control": f"{LOOPBACK}:{free_port()}", "fabric_node": LOOPBACK,
                            "metrics": f"{LOOPBACK}:{free_port()}"}
    d = spawn_daemon(tmp_path, keys, wrap=lambda cmd: ["prlimit", "--nofile=256:256", *cmd])
    held: list[socket.socket] = []
    try:
        base = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        host, port = keys["metrics"].rsplit(":", 1)
        for _ in range(300):
            held.append(socket.create_connection((host, int(port)), timeout=5))
        time.sleep(1.5)
        fds = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        assert fds <= base + 40, (base, fds)
        text = d.log.read_text()
        assert text.count("Too many open files") <= 2, text[-2000:]
        assert d.alive()
    finally:
        for s in held:
            s.close()
        d.stop()
