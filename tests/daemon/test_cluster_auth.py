"""The cluster token on control connections, and clients watching membership.

Daemons run as ``p2pxfer daemon`` subprocesses on 127.0.0.1. A daemon with a
``cluster_token`` answers a peer connection only after a mutual HMAC
challenge-response (hello carries the caller's nonce, welcome the daemon's
nonce and proof, then ``auth`` the caller's proof); the raw-socket tests speak
the protocol by hand to show what a caller without the token gets.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon_helpers import (
    LOOPBACK,
    Agent,
    DaemonProc,
    Plan,
    free_port,
    start_daemon,
    wait_for,
)
from daemon_helpers import RawControl as RawPeer
from p2pxfer.client import MemberUpdate, connect
from p2pxfer.membership import ClusterAuth
from p2pxfer.protocol import SCHEMA_VERSION, encode_frame

TOKEN = "the-right-token"


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    out: list[Any] = []
    yield out
    for p in reversed(out):
        if isinstance(p, Agent):
            p.close()
        else:
            p.stop()


def logged(d: DaemonProc, event: str) -> bool:
    return event in d.log.read_text(errors="replace")


def test_peer_connections_prove_the_token(tmp_path: Path, procs: list[Any]) -> None:
    """Static peers (no membership) with a token: daemons that share it
    transfer; one with another token is refused with ``auth_failed`` on both
    sides and logged; nothing is served before a caller proved the token."""
    a = start_daemon(tmp_path, "node-a", control_port=free_port(), cluster_token=TOKEN)
    procs.append(a)
    b = start_daemon(tmp_path, "node-b", control_port=free_port(), cluster_token=TOKEN,
                     peers=[{"name": "node-a", "address": a.control}])
    procs.append(b)
    evil = start_daemon(tmp_path, "node-e", control_port=free_port(),
                        cluster_token="a-guess", peers=[{"name": "node-a", "address": a.control}])
    procs.append(evil)

    plan = Plan(0xA07, pieces=64, min_len=1 << 10, max_len=8 << 10, region=2 << 20)
    target = Agent("trio", a.socket, "target")
    procs.append(target)
    assert target.ok("export", "r", plan.region) == plan.region
    writer = Agent("trio", b.socket, "writer")
    procs.append(writer)
    pieces = writer.ok("write", "node-a", "r", plan, 1)
    assert target.call("verify", "r", plan, 1, pieces)[0] == "ok"
    # b, having proved the token, was added to a's peers (it can be reached back).
    assert "node-b" in {p["name"] for p in a.status()["peers"]}

    intruder = Agent("trio", evil.socket, "intruder")
    procs.append(intruder)
    reply = intruder.call("write", "node-a", "r", plan, 2)
    assert reply[0] == "raised" and reply[2] == "auth_failed", reply
    assert "did not prove the cluster token" in reply[3], reply
    wait_for(lambda: logged(evil, "peer.auth_failed"), "the intruder to log the refusal")
    assert "node-e" not in {p["name"] for p in a.status()["peers"]}
    # a keeps serving the others.
    pieces = writer.ok("write", "node-a", "r", plan, 3)
    assert target.call("verify", "r", plan, 3, pieces)[0] == "ok"


def test_raw_caller_without_the_token_gets_nothing(tmp_path: Path, procs: list[Any]) -> None:
    a = start_daemon(tmp_path, "node-a", control_port=free_port(), cluster_token=TOKEN)
    procs.append(a)
    auth = ClusterAuth(TOKEN.encode())

    # No challenge, no proof: a request is refused and the connection closed.
    raw = RawPeer(a.control)
    welcome = raw.hello()
    assert len(welcome["nonce"]) >= 16 and "proof" not in welcome
    reply = raw.request({"t": "resolve", "id": 1, "region": "r"})
    assert reply is not None and reply["t"] == "error" and reply["code"] == "auth_failed"
    assert raw.frame() is None  # closed
    raw.close()
    wait_for(lambda: logged(a, "peer.auth_required"), "a to log the unauthenticated request")

    # A challenge: the daemon proves the token; a wrong answer is refused, logged, closed.
    mine = os.urandom(16)
    raw = RawPeer(a.control)
    welcome = raw.hello(nonce=mine)
    assert auth.check_connection("responder", mine, welcome["nonce"], "node-a", welcome["proof"])
    assert not ClusterAuth(b"other").check_connection("responder", mine, welcome["nonce"],
                                                      "node-a", welcome["proof"])
    # A proof replayed from the daemon's own side is not the caller's proof.
    reply = raw.request({"t": "auth", "id": 1, "proof": welcome["proof"]})
    assert reply is not None and reply["code"] == "auth_failed"
    assert raw.frame() is None
    raw.close()
    wait_for(lambda: logged(a, "peer.auth_failed"), "a to log the wrong proof")

    # The right answer: requests are served.
    mine = os.urandom(16)
    raw = RawPeer(a.control)
    welcome = raw.hello(nonce=mine)
    proof = auth.connection_proof("initiator", mine, welcome["nonce"], "intruder")
    raw.send({"t": "auth", "id": 1, "proof": proof})
    # From the answer to auth on, every frame both ways carries a MAC.
    raw.secure(*auth.session_keys(mine, welcome["nonce"], "intruder", "node-a"))
    reply = raw.frame()
    assert reply is not None and reply["t"] == "ok", reply
    reply = raw.request({"t": "resolve", "id": 2, "region": "nope"})
    assert reply is not None and reply["code"] == "unknown_region", reply
    raw.close()
    assert a.alive()


def test_a_caller_that_never_proves_the_token_is_cut_off(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """It holds a connection (and a file descriptor) for AUTH_TIMEOUT_S at most."""
    from types import SimpleNamespace

    from p2pxfer.daemon import Daemon, DaemonConfig
    from p2pxfer.daemon import _auth as auth_mod
    from p2pxfer.daemon._control import serve_peer

    monkeypatch.setattr(auth_mod, "AUTH_TIMEOUT_S", 0.3)
    engine: Any = SimpleNamespace(config=SimpleNamespace(incarnation=1))
    d = Daemon(DaemonConfig(node="node-a", cluster_token=TOKEN), engine)

    async def main() -> None:
        ours, theirs = trio.socket.socketpair()
        caller = trio.SocketStream(theirs)
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_peer, d, trio.SocketStream(ours))
            await caller.send_all(encode_frame({"t": "hello", "v": SCHEMA_VERSION,
                                                "role": "daemon", "name": "slow"}, 1 << 20))
            with trio.fail_after(5):
                while await caller.receive_some(1 << 16):
                    pass  # the welcome, then nothing until the daemon hangs up
        assert 0.3 <= trio.current_time() - t0 < 5
        await caller.aclose()

    trio.run(main)


def test_idle_peer_links_are_closed_and_reopened(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two in-process daemons (control ports only, on 127.0.0.1): a link
    unused for LINK_IDLE_S is closed, and the next request dials again."""
    from types import SimpleNamespace

    from p2pxfer.daemon import Daemon, DaemonConfig
    from p2pxfer.daemon import _peers as peers_mod

    monkeypatch.setattr(peers_mod, "LINK_IDLE_S", 0.2)
    engine: Any = SimpleNamespace(config=SimpleNamespace(incarnation=1))

    def daemon(name: str) -> Any:
        return Daemon(DaemonConfig(node=name, control=f"{LOOPBACK}:0",
                                   cluster_token=TOKEN), engine)

    async def main() -> None:
        a, b = daemon("node-a"), daemon("node-b")
        async with trio.open_nursery() as nursery:
            a.nursery, b.nursery = nursery, nursery
            await a.serve_peers(nursery)
            await b.serve_peers(nursery)
            nursery.start_soon(a.peers.close_idle_links)
            a.peers.add("node-b", b.control_address)
            link = a.peers.link("node-b")
            with trio.fail_after(10):
                # b learned a's control address once a proved the token
                peers = (await link.request("peers"))["peers"]
                assert [p["name"] for p in peers] == ["node-a"]
                assert link.connected
                while link.connected:
                    await trio.sleep(0.05)
                assert (await link.request("peers"))["peers"] == peers
                assert link.connected
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_caller_refuses_a_daemon_that_cannot_prove_the_token(tmp_path: Path,
                                                             procs: list[Any]) -> None:
    """Mutual: a daemon holding the token will not take descriptors from a
    peer that does not (here: one with no token at all)."""
    open_one = start_daemon(tmp_path, "node-o", control_port=free_port())
    procs.append(open_one)
    a = start_daemon(tmp_path, "node-a", control_port=free_port(), cluster_token=TOKEN,
                     peers=[{"name": "node-o", "address": open_one.control}])
    procs.append(a)
    target = Agent("trio", open_one.socket, "target")
    procs.append(target)
    plan = Plan(0xB0B, pieces=8, min_len=1 << 10, max_len=4 << 10, region=1 << 20)
    assert target.ok("export", "r", plan.region) == plan.region
    writer = Agent("trio", a.socket, "writer")
    procs.append(writer)
    reply = writer.call("write", "node-o", "r", plan, 1)
    assert reply[0] == "raised" and reply[2] == "auth_failed", reply
    wait_for(lambda: logged(a, "peer.auth_failed"), "a to log the unproven peer")


# -- clients watching membership --------------------------------------------------------------

def test_client_watches_membership_looks_up_peers_and_regions(tmp_path: Path,
                                                              procs: list[Any]) -> None:
    ports = {n: free_port() for n in ("node-a", "node-b", "node-c")}
    keys = {"membership": "embedded", "cluster_token": TOKEN,
            "seeds": [f"{LOOPBACK}:{ports['node-a']}"]}
    a = start_daemon(tmp_path, "node-a", control_port=ports["node-a"], **keys)
    procs.append(a)
    b = start_daemon(tmp_path, "node-b", control_port=ports["node-b"], **keys)
    procs.append(b)
    wait_for(lambda: {p["name"] for p in a.status()["peers"]} == {"node-a", "node-b"},
             "a to see b")
    stats = a.status()["membership_stats"]
    assert stats["sent"] > 0 and stats["received"] > 0 and stats["auth_failures"] == 0
    seen: list[MemberUpdate] = []

    async def main() -> None:
        async with connect(a.socket) as client:
            found = await client.lookup("node-b")
            assert found is not None and found["address"] == f"{LOOPBACK}:{ports['node-b']}"
            assert found["state"] == "alive" and found["incarnation"] > 0
            assert await client.lookup("node-x") is None
            # The region directory: who exports what, across the cluster.
            on_b_cm = connect(b.socket)
            on_b = await on_b_cm.__aenter__()
            await on_b.export("kv", await on_b.alloc(1 << 16))
            assert await client.locate("kv") == ["node-b"]
            assert await client.locate("absent") == []
            updates = client.watch_members(poll_s=0.5)

            async def until(pred: Any, what: str) -> None:
                with trio.fail_after(20):
                    async for u in updates:
                        seen.append(u)
                        if pred(u):
                            return
                raise AssertionError(f"the updates ended before {what}")

            await until(lambda u: u.event == "present" and u.name == "node-b", "b present")
            assert {u.name for u in seen if u.event == "present"} >= {"node-a", "node-b"}
            c = await trio.to_thread.run_sync(lambda: start_daemon(
                tmp_path, "node-c", control_port=ports["node-c"], **keys))
            procs.append(c)
            await until(lambda u: u.event == "joined" and u.name == "node-c", "c joined")
            inc = seen[-1].incarnation
            assert seen[-1].address == f"{LOOPBACK}:{ports['node-c']}"
            c.proc.kill()
            await until(lambda u: u.event == "dead" and u.name == "node-c", "c dead")
            assert seen[-1].incarnation == inc and seen[-1].state == "dead"
            t0 = time.monotonic()
            assert b.stop() == 0
            await until(lambda u: u.event == "left" and u.name == "node-b", "b left")
            assert time.monotonic() - t0 < 10
            # b's client is still connected, its export never withdrawn: gone with b.
            assert await client.locate("kv") == []
            await on_b_cm.__aexit__(None, None, None)

    trio.run(main)
    events = [(u.event, u.name) for u in seen if u.event != "present"]
    # In order, each once; a suspicion may come before the death.
    assert events.index(("joined", "node-c")) < events.index(("dead", "node-c")) < \
        events.index(("left", "node-b")), events


def test_watch_needs_membership(tmp_path: Path, procs: list[Any]) -> None:
    a = start_daemon(tmp_path, "node-a")
    procs.append(a)

    async def main() -> None:
        async with connect(a.socket) as client:
            with pytest.raises(Exception, match="membership is off") as info:
                async for _ in client.watch_members():
                    break
            assert getattr(info.value, "code", "") == "bad_request"

    trio.run(main)
