"""The control round trip's fast paths keep every behaviour of the slow ones.

Client side (``client/_wire.py``): under trio a caller reads its own reply
when nobody else reads (it *leads*) and hands the socket over when it is
done or cancelled; under asyncio a loop callback reads; a request nobody
awaits is read by the reader task. ``SyncClient`` sends requests the daemon
answers in turn from the calling thread when nothing else is in flight.
Daemon side (``daemon/_sessions.py``): requests answered in turn cost no
scheduler round, but a session still yields every ``FAIR_REQUESTS``.

One daemon (node-a, no peers) in its own process; clients here, on trio,
asyncio and the blocking facade.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import trio

import p2pxfer
from daemon_helpers import DaemonProc, start_daemon
from p2pxfer.errors import ConnectionLost, UnknownRegion, WaitTimeout
from p2pxfer.kv import KVLayout
from p2pxfer.protocol import SCHEMA_VERSION, FrameDecoder, encode_frame

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("fastpath"), "node-a")
    try:
        yield d
    finally:
        d.stop()
    assert "request.crashed" not in d.log.read_text(), d.log_tail()


async def _mixed(client: p2pxfer.Client) -> None:
    """Many callers at once on one client (anyio: trio or asyncio): no-op
    requests, failing ones, waits that time out (cancel crosses the socket)
    and a leader cancelled while another caller waits behind it."""
    mem = await client.alloc(4096, "fast")
    await client.export("fast", mem)
    pool = await client.kv_pool("fast-pool", KVLayout(2, 4, 4096))
    got: list[int] = []

    async def noops(k: int) -> None:
        for i in range(40):
            if i % 3 == 0:
                assert (await client.status())["node"] == "node-a"
            else:
                assert await client.peers() == []
            got.append(k)

    async def failing() -> None:
        for _ in range(10):
            with pytest.raises(UnknownRegion):
                await client.unexport("no-such-region")

    async def timing_out(imm: int) -> None:
        with pytest.raises(WaitTimeout):
            await client.wait_imm(imm, 1, timeout=0.05)

    async def cancelled_leader_then_follower() -> None:
        # The first wait may lead (read the socket); cancelled, it must hand
        # the socket over: the second, whose answer comes later (the daemon
        # times it out, the client sets no timeout), must still hear it.
        async with anyio.create_task_group() as tg:
            async def leader() -> None:
                with anyio.move_on_after(0.2) as scope:
                    await client.wait_imm(901, 1)
                assert scope.cancelled_caught

            tg.start_soon(leader)
            await anyio.sleep(0.01)
            with pytest.raises(WaitTimeout):
                await pool.wait_layers(5, 0, timeout=1.0)

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            for k in range(8):
                tg.start_soon(noops, k)
            tg.start_soon(failing)
            for imm in range(5):
                tg.start_soon(timing_out, 800 + imm)
            tg.start_soon(cancelled_leader_then_follower)
    assert sorted(got) == sorted(list(range(8)) * 40)
    # Nothing was left waiting in the daemon, nothing unread here.
    assert not client._conv._pending and getattr(client._conv, "_leader", None) is None
    await client.unexport("fast")
    await client.free(mem)


async def _unattended(client: p2pxfer.Client) -> None:
    """A request whose reply nobody awaits yet (as ``kv_push`` leaves one):
    other calls go on, and its reply is there when it is awaited."""
    with anyio.fail_after(TIMEOUT):
        pending = await client._conv.start("locate", region="nowhere")
        for _ in range(20):
            assert await client.peers() == []
        await anyio.sleep(0.05)
        assert pending.reply is not None  # read meanwhile, by someone
        assert await client._conv.finish(pending) == {"nodes": []}


def test_trio_callers_share_the_socket(daemon: DaemonProc) -> None:
    async def main() -> None:
        async with p2pxfer.connect(daemon.socket) as client:
            await _mixed(client)
            await _unattended(client)

    trio.run(main)


def test_asyncio_callers_share_the_socket(daemon: DaemonProc) -> None:
    async def main() -> None:
        async with p2pxfer.connect(daemon.socket) as client:
            await _mixed(client)
            await _unattended(client)

    asyncio.run(main())


def test_trio_leader_cancelled_while_reading(daemon: DaemonProc) -> None:
    """The only caller, cancelled while it reads the socket itself: the
    daemon is told, and the next call finds the conversation in order."""
    async def main() -> None:
        async with p2pxfer.connect(daemon.socket) as client:
            mem = await client.alloc(4096, "lead")
            await client.export("lead", mem)
            with trio.fail_after(TIMEOUT):
                for _ in range(5):
                    with trio.move_on_after(0.02) as scope:
                        await client.wait_imm(7, 1)
                    assert scope.cancelled_caught
                    assert client._conv._leader is None and not client._conv._pending
                    assert await client.peers() == []

    trio.run(main)


def test_sync_client_needs_no_thread_and_threads_take_turns(daemon: DaemonProc) -> None:
    """A ``SyncClient`` is a blocking socket: making and using one starts no
    thread and no event loop. Threads sharing one take turns: a call made
    while another thread waits runs once that wait ends, and both are right."""
    before = threading.active_count()
    with p2pxfer.SyncClient(daemon.socket) as client:
        for _ in range(20):
            assert client.peers() == []
            assert client.status()["node"] == "node-a"
        mem = client.alloc(4096, "sync-fast")  # passes a descriptor
        assert client.export("sync-fast", mem).length == 4096
        assert threading.active_count() == before

        errors: list[BaseException] = []
        started = threading.Event()

        def waiter() -> None:
            try:
                started.set()
                with pytest.raises(WaitTimeout, match="0 of 1 arrivals"):
                    client.wait_imm(5, 1, timeout=0.5)
            except BaseException as exc:  # reported below
                errors.append(exc)

        t = threading.Thread(target=waiter)
        t.start()
        started.wait()
        while t.is_alive():
            assert client.peers() == []
            assert client.lookup("node-b") is None
        t.join()
        assert not errors, errors
        client.unexport("sync-fast")
        client.free(mem)
        assert client.peers() == []


def test_sync_client_interrupted_call_is_cancelled_first(daemon: DaemonProc,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A blocking call interrupted while it waits for its reply (Ctrl-C):
    the daemon is told and has stopped serving it when ``KeyboardInterrupt``
    comes out (a wait no longer counts: the arrival after it is the next
    wait's); later calls get their own replies."""
    with p2pxfer.SyncClient(daemon.socket) as client:
        conv = client._c
        real_select = select.select
        calls = {"n": 0}

        def interrupting(*args: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise KeyboardInterrupt
            return real_select(*args)

        monkeypatch.setattr(select, "select", interrupting)
        with pytest.raises(KeyboardInterrupt):
            client.wait_imm(9, 1, timeout=30)
        monkeypatch.undo()
        assert conv._closed is None  # cancelled cleanly, the conversation stands
        for _ in range(5):
            assert client.peers() == []
            assert client.status()["node"] == "node-a"


def test_a_pipelining_client_lets_the_daemon_breathe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests answered in turn never wait, so a session serving a burst of
    them yields every FAIR_REQUESTS to the rest of the daemon."""
    from types import SimpleNamespace

    from p2pxfer.daemon import Daemon, DaemonConfig
    from p2pxfer.daemon import _sessions as sessions_mod

    engine: Any = SimpleNamespace(config=SimpleNamespace(incarnation=1))
    d = Daemon(DaemonConfig(node="node-a"), engine)
    burst = 10 * sessions_mod.FAIR_REQUESTS

    async def main() -> None:
        ours, theirs = trio.socket.socketpair()
        session = sessions_mod.ClientSession(d, ours, pid=1, uid=os.getuid())
        frames = [encode_frame({"t": "hello", "v": SCHEMA_VERSION, "role": "client"})]
        frames += [encode_frame({"t": "peers", "id": i + 1}) for i in range(burst)]
        await theirs.send(b"".join(frames))  # all at once: nothing to wait for
        ticks: list[int] = []
        replies = FrameDecoder(1 << 20)
        seen = 0

        async def ticker() -> None:
            while True:
                ticks.append(seen)
                await trio.lowlevel.checkpoint()

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.run)
                nursery.start_soon(ticker)
                while seen < burst + 1:
                    replies.feed(await theirs.recv(1 << 16))
                    while replies.next_frame() is not None:
                        seen += 1
                nursery.cancel_scope.cancel()
        theirs.close()
        # The ticker ran while the burst was being served, not only around it.
        assert len({t for t in ticks if 0 < t < burst}) >= 3, ticks[:50]

    trio.run(main)


def _hang_up_on_first_request(path: str) -> threading.Thread:
    """A fake daemon at ``path``: welcomes one client, then hangs up on its
    first request without answering."""
    from p2pxfer.protocol import RESPONDER, Connection, Message

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        with listener, listener.accept()[0] as sock:
            sock.settimeout(TIMEOUT)
            conn = Connection("client", RESPONDER)
            while True:
                conn.receive_data(sock.recv(1 << 16))
                while isinstance(msg := conn.next_event(), Message):
                    if msg.kind != "hello":
                        return
                    sock.sendall(conn.send("welcome", v=SCHEMA_VERSION, node="fake",
                                           incarnation=1, max_frame=1 << 20))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_lost_daemon_on_every_fast_path(tmp_path: Path) -> None:
    """The daemon hangs up while a request waits: asyncio (the loop callback
    reads the end) and SyncClient (the blocking call reads it) raise
    ``ConnectionLost``, and so does every later call."""
    async def on_asyncio(path: str) -> None:
        async with p2pxfer.connect(path) as c:
            assert c.node == "fake"
            with pytest.raises(ConnectionLost, match="closed the connection"):
                await c.status()
            with pytest.raises(ConnectionLost):
                await c.peers()

    path = str(tmp_path / "a.sock")
    t = _hang_up_on_first_request(path)
    asyncio.run(asyncio.wait_for(on_asyncio(path), TIMEOUT))
    t.join(TIMEOUT)

    path = str(tmp_path / "s.sock")
    t = _hang_up_on_first_request(path)
    with p2pxfer.SyncClient(path) as c:
        with pytest.raises(ConnectionLost, match="closed the connection"):
            c.status()
        with pytest.raises(ConnectionLost):
            c.peers()
    t.join(TIMEOUT)
