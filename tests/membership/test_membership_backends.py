"""The membership backends for real: SWIM over UDP on 127.0.0.1, and etcd.

Several backends run in one trio process, each with its own socket (embedded)
or its own lease (etcd). The etcd tests start a real ``etcd`` on loopback
with free ports and a temporary data directory, and skip (saying why) where
the binary is missing. Every wait is bounded with ``fail_after``.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable, Sequence

import httpx
import pytest
import structlog
import trio
import trio.testing

import conftest
from daemon_helpers import free_port
from p2pxfer.membership import (
    AuthFailed,
    EmbeddedBackend,
    EtcdBackend,
    Member,
    MemberAlive,
    MemberDead,
    MemberJoined,
    MemberLeft,
    MemberRestarted,
    MembershipBackend,
    MembershipError,
    MembershipEvent,
    MemberState,
    MemberSuspect,
    PeerLost,
    StaleIncarnation,
    SwimConfig,
    new_incarnation,
)
from p2pxfer.membership._backend import SUBSCRIBER_BUFFER

ALIVE, DEAD, LEFT = MemberState.ALIVE, MemberState.DEAD, MemberState.LEFT
TOKEN = b"test-cluster-token"
LOOPBACK = "127.0.0.1"
# Fast timings for tests: a 0.25 s period, suspicion of 4 periods at this size.
FAST = SwimConfig(period=0.25, ack_timeout=0.1, suspicion_mult=4.0, reconnect_interval=1.0,
                  join_retry=0.3, sync_interval=1.0, sync_quiet=0.25)


#: the lag meter's tick, and the lateness per tick it takes for jitter
LAG_TICK_S, LAG_JITTER_S = 0.02, 0.002


async def wait_until(cond: Callable[[], bool], timeout: float, what: str, *,
                     own_time: bool = False) -> float:
    """conftest's ``wait_until`` polling every 20 ms, then every other task
    runs until it blocks: the event published with the state change the test
    saw is in its collector's list before the test checks it (the collector
    may be scheduled after the test task in the same batch).

    ``own_time``: what it returns is this process's own time, less how late
    its event loop ran its timers meanwhile (a tick's lateness past jitter).
    Every SWIM member of these tests runs in this loop: on a starved CPU
    their probes and suspicion timers were that late too, and a bound on
    how long the protocol takes holds in that time (beside two CPU hogs a
    death took 4.07 s of wall time against a 4 s bound)."""
    lag = 0.0

    async def meter() -> None:
        nonlocal lag
        while True:
            t0 = trio.current_time()
            await trio.sleep(LAG_TICK_S)
            lag += max(0.0, trio.current_time() - t0 - LAG_TICK_S - LAG_JITTER_S)

    async with trio.open_nursery() as nursery:
        if own_time:
            nursery.start_soon(meter)
        took = await conftest.wait_until(cond, timeout, what, interval=0.02)
        nursery.cancel_scope.cancel()
    await trio.testing.wait_all_tasks_blocked()
    return took - lag


def sees(backend: MembershipBackend, name: str, state: MemberState,
         incarnation: int | None = None) -> bool:
    m = backend.member(name)
    return m is not None and m.state is state and (incarnation is None
                                                   or m.incarnation == incarnation)


async def collect(channel: trio.MemoryReceiveChannel[MembershipEvent],
                  into: list[MembershipEvent]) -> None:
    async for ev in channel:
        into.append(ev)


# -- embedded (SWIM over UDP) -----------------------------------------------------------


# Failure detection slow enough that a restart always beats it, even on a loaded
# 2-core machine: the "restart before detection" scenario must not race.
SLOW_DETECTION = SwimConfig(period=0.25, ack_timeout=0.1, suspicion_mult=40.0,
                            reconnect_interval=1.0, join_retry=0.3, sync_interval=1.0,
                            sync_quiet=0.25)


def embedded(name: str, seeds: Sequence[str] = (),
             config: SwimConfig = FAST) -> EmbeddedBackend:
    return EmbeddedBackend(name, f"{LOOPBACK}:0", TOKEN, seeds, config=config,
                           join_timeout=3.0)


async def test_embedded_join_kill_leave_restart() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a = embedded("a")
            await a.start(nursery)
            assert a.joined and a.address.startswith(LOOPBACK)
            b, c, d = embedded("b", [a.address]), embedded("c", [a.address]), \
                embedded("d", [a.address])
            for x in (b, c, d):
                await x.start(nursery)
                assert x.joined
            everyone = [a, b, c, d]
            await wait_until(lambda: all(sees(x, y.name, ALIVE) for x in everyone
                                         for y in everyone), 5, "all alive")
            events: list[MembershipEvent] = []
            nursery.start_soon(collect, b.events(), events)

            # Killed: it just stops answering. The others know within a few seconds.
            c_inc = c.incarnation
            await c.stop(graceful=False)
            took = await wait_until(lambda: all(sees(x, "c", DEAD) for x in (a, b, d)), 6,
                                    "c dead", own_time=True)
            assert took < 4.0, took
            assert any(isinstance(e, MemberDead) and e.member.name == "c" for e in events)
            assert not b.is_current("c", c_inc)
            with pytest.raises(PeerLost):
                b.check_current("c", c_inc)

            # Graceful leave: seen as left (not dead), quickly.
            await d.stop()
            took = await wait_until(lambda: sees(a, "d", LEFT) and sees(b, "d", LEFT), 3,
                                    "d left", own_time=True)
            assert took < 1.0, took
            assert any(isinstance(e, MemberLeft) and e.member.name == "d" for e in events)

            # c comes back: a new life; its old incarnation stays refused.
            c2 = embedded("c", [b.address])
            await c2.start(nursery)
            assert c2.incarnation > c_inc
            await wait_until(lambda: sees(a, "c", ALIVE, c2.incarnation)
                             and sees(b, "c", ALIVE, c2.incarnation), 5, "c back")
            assert not a.is_current("c", c_inc) and a.is_current("c", c2.incarnation)
            with pytest.raises(StaleIncarnation):
                a.check_current("c", c_inc)
            assert any(isinstance(e, MemberJoined) and e.member.incarnation == c2.incarnation
                       for e in events)
            for x in (a, b, c2):
                await x.stop()
            nursery.cancel_scope.cancel()


async def test_embedded_restart_before_detection_is_reported_as_restart() -> None:
    with trio.fail_after(20):
        slow = SLOW_DETECTION
        async with embedded("a", config=slow) as a, \
                embedded("b", [a.address], config=slow) as b:
            c = embedded("c", [a.address], config=slow)
            async with trio.open_nursery() as nursery:
                await c.start(nursery)
                await wait_until(lambda: sees(a, "c", ALIVE) and sees(b, "c", ALIVE), 5, "c")
                events: list[MembershipEvent] = []
                nursery.start_soon(collect, a.events(), events)
                old = c.incarnation
                await c.stop(graceful=False)
                c2 = embedded("c", [b.address], config=slow)
                await c2.start(nursery)
                await wait_until(lambda: sees(a, "c", ALIVE, c2.incarnation), 5, "restart")
                restarted = [e for e in events if isinstance(e, MemberRestarted)]
                assert restarted and restarted[0].previous_incarnation == old
                await c2.stop()
                nursery.cancel_scope.cancel()


async def test_embedded_refuses_a_daemon_without_the_token() -> None:
    with trio.fail_after(20), structlog.testing.capture_logs() as logs:
        async with embedded("a") as a:
            intruder = EmbeddedBackend("mallory", f"{LOOPBACK}:0", b"wrong-token",
                                       [a.address], config=FAST,
                                       join_timeout=1.0)
            async with intruder:
                assert not intruder.joined
                await trio.sleep(0.5)
                assert a.member("mallory") is None
                assert intruder.members() == [intruder.member("mallory")]
    refused = [entry for entry in logs if entry["event"] == "membership.auth_failed"]
    assert refused and refused[0]["log_level"] == "warning"
    assert "MAC" in refused[0]["reason"] and refused[0]["node"] == "a"
    assert any(entry["event"] == "membership.join_pending" for entry in logs)


async def test_embedded_subscriptions_end_when_stopped() -> None:
    with trio.fail_after(10):
        a = embedded("a")
        async with a:
            channel = a.events()
        assert [ev async for ev in channel] == []
        late = a.events()
        assert [ev async for ev in late] == []


async def test_a_subscriber_that_falls_behind_is_cut_off() -> None:
    backend = embedded("a")
    slow, fine = backend.events(), backend.events()
    joined = MemberJoined(Member("x", "127.0.0.1:1", 1))
    backend._publish([joined] * SUBSCRIBER_BUFFER)
    async for _ in fine:  # keeps up
        break
    backend._publish([joined])
    got = [ev async for ev in slow]  # what was buffered, then the end
    assert len(got) == SUBSCRIBER_BUFFER
    assert fine.statistics().current_buffer_used == SUBSCRIBER_BUFFER


async def test_embedded_bad_bind_is_a_clear_error() -> None:
    with pytest.raises(MembershipError, match="host:port"):
        EmbeddedBackend("a", "no-port", TOKEN)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            with pytest.raises(MembershipError, match="advertise"):
                await EmbeddedBackend("a", "0.0.0.0:0", TOKEN).start(nursery)


# -- etcd (the `etcd` fixture lives in conftest.py) -----------------------------------


def etcd_member(name: str, endpoint: str, prefix: str, **kw: object) -> EtcdBackend:
    return EtcdBackend(name, f"{LOOPBACK}:{7000 + ord(name[0])}", TOKEN, endpoint, ttl=2,
                       prefix=prefix, **kw)  # type: ignore[arg-type]


async def test_etcd_join_leave_and_lease_expiry(etcd: str) -> None:
    prefix = f"/p2pxfer-test-{uuid.uuid4().hex}/members/"
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            a, b, c = (etcd_member(n, etcd, prefix) for n in "abc")
            for x in (a, b, c):
                await x.start(nursery)
            everyone = [a, b, c]
            await wait_until(lambda: all(sees(x, y.name, ALIVE, y.incarnation)
                                         for x in everyone for y in everyone), 5, "joined")
            assert a.member("b").address == f"{LOOPBACK}:{7000 + ord('b')}"  # type: ignore[union-attr]
            events: list[MembershipEvent] = []
            nursery.start_soon(collect, a.events(), events)

            await c.stop()  # graceful: "left", then its lease is revoked
            took = await wait_until(lambda: sees(a, "c", LEFT) and sees(b, "c", LEFT), 3,
                                    "c left", own_time=True)
            assert took < 1.0, took
            assert [type(e) for e in events if e.member.name == "c"] == [MemberLeft]  # type: ignore[union-attr]

            b_inc = b.incarnation
            await b.stop(graceful=False)  # stops keeping its lease alive
            took = await wait_until(lambda: sees(a, "b", DEAD), 8, "b's lease expired")
            assert 1.0 < took < 6.0, took
            assert any(isinstance(e, MemberDead) and e.member.name == "b" for e in events)
            assert not a.is_current("b", b_inc)

            b2 = etcd_member("b", etcd, prefix)
            await b2.start(nursery)
            await wait_until(lambda: sees(a, "b", ALIVE, b2.incarnation), 3, "b back")
            assert any(isinstance(e, MemberJoined) and e.member.incarnation == b2.incarnation
                       for e in events)
            assert a.is_current("b", b2.incarnation) and not a.is_current("b", b_inc)
            assert sees(b2, "a", ALIVE, a.incarnation) and sees(b2, "c", ALIVE) is False
            for x in (a, b2):
                await x.stop()
            nursery.cancel_scope.cancel()


async def test_etcd_restart_before_expiry_and_forged_members(etcd: str) -> None:
    prefix = f"/p2pxfer-test-{uuid.uuid4().hex}/members/"
    with trio.fail_after(30), structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            a, b = etcd_member("a", etcd, prefix), etcd_member("b", etcd, prefix)
            await a.start(nursery)
            await b.start(nursery)
            await wait_until(lambda: sees(a, "b", ALIVE), 5, "b")
            events: list[MembershipEvent] = []
            nursery.start_soon(collect, a.events(), events)
            old = b.incarnation
            await b.stop(graceful=False)
            b2 = etcd_member("b", etcd, prefix, incarnation=new_incarnation())
            await b2.start(nursery)  # before the old lease ran out
            await wait_until(lambda: sees(a, "b", ALIVE, b2.incarnation), 3, "restart")
            restarted = [e for e in events if isinstance(e, MemberRestarted)]
            assert restarted and restarted[0].previous_incarnation == old
            await trio.sleep(3)  # the old lease expires: the key is b2's now, nothing changes
            assert sees(a, "b", ALIVE, b2.incarnation)
            assert not any(isinstance(e, MemberDead) for e in events)

            # Someone with etcd access but without the cluster token.
            value = json.dumps({"v": 1, "name": "mallory", "address": "127.0.0.1:1",
                                "incarnation": 1, "state": "alive", "mac": "00" * 32})
            async with httpx.AsyncClient(base_url=etcd) as http:
                await http.post("/v3/kv/put", json={
                    "key": base64.b64encode(f"{prefix}mallory".encode()).decode(),
                    "value": base64.b64encode(value.encode()).decode()})
            await wait_until(lambda: any(isinstance(e, AuthFailed) for e in events), 3,
                             "forged member refused")
            assert a.member("mallory") is None
            for x in (a, b2):
                await x.stop()
            nursery.cancel_scope.cancel()
    assert any(entry["event"] == "membership.auth_failed" for entry in logs)


async def test_etcd_a_lapsed_lease_whose_host_accepts_is_suspect_not_dead(etcd: str) -> None:
    """With ``host_check``: b stops keeping its lease (a starved daemon), its
    key goes, but a socket still listens at its address: a sees it suspect,
    never dead, and b's same life putting its key back is ``MemberAlive``.
    c's lease lapses with nothing listening at its address: refused, dead at
    once (no grace to wait out)."""
    prefix = f"/p2pxfer-test-{uuid.uuid4().hex}/members/"
    listener = trio.socket.socket()
    await listener.bind((LOOPBACK, 0))
    listener.listen(8)  # never accepted from: the kernel answers for a stopped process
    b_addr = f"{LOOPBACK}:{listener.getsockname()[1]}"
    c_addr = f"{LOOPBACK}:{free_port()}"  # nothing listens: refused

    def member(name: str, address: str, **kw: object) -> EtcdBackend:
        return EtcdBackend(name, address, TOKEN, etcd, ttl=2, prefix=prefix,
                           host_check=0.3, starved_grace=8.0, **kw)  # type: ignore[arg-type]

    with trio.fail_after(40), listener:
        async with trio.open_nursery() as nursery:
            a, b, c = member("a", f"{LOOPBACK}:1"), member("b", b_addr), member("c", c_addr)
            for x in (a, b, c):
                await x.start(nursery)
            await wait_until(lambda: sees(a, "b", ALIVE) and sees(a, "c", ALIVE), 5, "joined")
            events: list[MembershipEvent] = []
            nursery.start_soon(collect, a.events(), events)

            b_inc = b.incarnation
            await b.stop(graceful=False)
            await wait_until(lambda: sees(a, "b", MemberState.SUSPECT), 8, "b's lease lapsed")
            await trio.sleep(1.5)  # several host checks, all answered
            assert sees(a, "b", MemberState.SUSPECT, b_inc)
            assert a.is_current("b", b_inc)
            b2 = member("b", b_addr, incarnation=b_inc)  # the same life runs again
            await b2.start(nursery)
            await wait_until(lambda: sees(a, "b", ALIVE, b_inc), 3, "b back")
            mine = [type(e) for e in events if getattr(e, "member", None)
                    and e.member.name == "b"]  # type: ignore[union-attr]
            assert mine == [MemberSuspect, MemberAlive], mine

            await c.stop(graceful=False)
            await wait_until(lambda: sees(a, "c", DEAD), 8, "c's lease lapsed")
            mine = [type(e) for e in events if getattr(e, "member", None)
                    and e.member.name == "c"]  # type: ignore[union-attr]
            assert mine == [MemberSuspect, MemberDead], mine
            assert a.detection_bound() == pytest.approx(2 + 2.0 + 0.3)
            for x in (a, b2):
                await x.stop()
            nursery.cancel_scope.cancel()


async def test_etcd_unreachable_is_a_clear_error() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            backend = EtcdBackend("a", "127.0.0.1:1", TOKEN, f"http://{LOOPBACK}:{free_port()}",
                                  timeout=1.0)
            with pytest.raises(MembershipError, match="etcd at"):
                await backend.start(nursery)
