"""Doorbells (``fabric/_bell.py``): a shm target's poller naps (shm CQs have
no wait fd), and a write whose completion needs the target's progress rings
it awake instead of waiting out the nap.

Two engines in this process over ``shm``; the target's nap is forced to 30 s
(its back-off cap and idle timeout, and its back-off set near the cap), so a
write that did not wake it could not finish within the 10 s it is given.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import trio

from conftest import engine_pair as pair
from conftest import wait_until
from p2pxfer.fabric import Poller, Rail
from p2pxfer.fabric._bell import Bells, Doorbell, bell_name
from p2pxfer.loopback import loopback_node
from p2pxfer.scatter import ScatterList

SIZE = 1 << 20
NAP_NS = 30_000_000_000
WITHIN_S = 10.0  # a third of the nap: only a woken target finishes in time


WRITERS: dict[str, dict[str, Any]] = {
    "express": {},  # the trio thread posts and polls (a small write on a quiet shard)
    "regular": {"inline_poll_ns": 0},  # the poller thread posts
    # no immediate: delivery-complete on every transmit is what needs b
    "delivery_complete": {"delivery_complete": True},
}


@pytest.mark.parametrize("path", list(WRITERS))
async def test_a_write_to_a_napping_shm_target_rings_it_awake(path: str) -> None:
    napper = {"backoff_max_ns": NAP_NS, "idle_timeout_ns": NAP_NS}
    imm = None if path == "delivery_complete" else 2
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, SIZE, dtype=np.uint8)
    region = np.zeros(SIZE, np.uint8)
    async with pair("shm", receiver=napper, **WRITERS[path]) as (a, b):
        desc = b.export(region, "r")
        a.register(src)
        with trio.fail_after(WITHIN_S):  # connects while b's naps are still short
            await a.write(src, desc, ScatterList.contiguous(4096), imm=1)
            await b.wait_imm(1, 1)
        poller = b.shards[0]._poller
        rung = poller.bells
        # Test-only reach: b's back-off at half the cap, so its next nap
        # lasts the whole 30 s; wait until it has begun.
        poller._p.backoff_ns = NAP_NS // 2
        await wait_until(lambda: poller._p.backoff_ns == NAP_NS, WITHIN_S, "b's long nap")
        sl = ScatterList.contiguous(64 << 10, 4096, 4096)  # past shm's inject size
        with trio.fail_after(WITHIN_S):
            await a.write(src, desc, sl, imm=imm)
            if imm is not None:
                await b.wait_imm(imm, 1)
        assert poller.bells > rung
        assert sum(r.rings for r in a.shards[0]._group.rails) > 0
        st = a.statistics()
        # Posted by the trio thread (done there, or handed to the poller
        # thread once its budget ran out), or by the poller thread.
        assert (st.express + st.express_handed_over >= 1) == (path != "regular")
    np.testing.assert_array_equal(region[:4096 + (64 << 10)], src[:4096 + (64 << 10)])


@contextlib.contextmanager
def shm_poller() -> Iterator[tuple[Poller, bytes, int]]:
    """An shm rail's poller (naps up to 10 s, a ring spins 1 us), its
    bell's name and the poller's wake fd."""
    with Rail.open("shm", node=loopback_node("shm")) as rail:
        assert rail.doorbell is not None and rail.doorbell.fd >= 0
        wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            yield Poller([rail], wake_fd=wake, backoff_max_ns=10_000_000_000,
                         bell_spin_ns=1000), bell_name(rail.address), wake
        finally:
            os.close(wake)


@contextlib.contextmanager
def asleep(poller: Poller, wake: int) -> Iterator[threading.Thread]:
    """A thread in ``poller.progress`` until the block ends, asleep in
    ppoll when the block starts (its first nap long enough to stay there
    until rung: a ring between two short naps would be read as a stale one
    and not counted); the thread, to ask whether it still waits."""
    tid: list[int] = []

    def sleep_on_it() -> None:
        tid.append(threading.get_native_id())
        poller.progress(timeout_ns=20_000_000_000)

    poller._p.backoff_ns = 10_000_000_000  # test-only reach: one long nap
    sleeper = threading.Thread(target=sleep_on_it)
    sleeper.start()
    try:
        deadline = time.monotonic() + 10
        while not (tid and in_poll(tid[0])):
            assert time.monotonic() < deadline, "the poller never slept"
            time.sleep(0.001)
        yield sleeper
    finally:
        os.eventfd_write(wake, 1)  # done: end its wait
        sleeper.join(10)
    assert not sleeper.is_alive()


def test_a_datagram_to_a_rails_doorbell_wakes_its_poller() -> None:
    """Any local datagram to the name wakes a sleeping poller (the bell
    carries nothing); rings queued while it was awake are read without
    counting as a wake-up (it reads its CQs once more instead)."""
    with shm_poller() as (poller, name, wake), \
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for payload in (b"", b"x" * 4000):
            s.sendto(payload, name)  # while no one sleeps on it
        assert len(poller.progress(timeout_ns=20_000_000)) == 0
        assert poller.bells == 0
        with asleep(poller, wake):
            s.sendto(b"", name)
            deadline = time.monotonic() + 10
            while poller.bells == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
        assert poller.bells == 1
        assert poller._p.bells_dropped == 0  # test-only reach


#: sends one empty datagram to the abstract name given in hex (run as
#: another user by the system's python3: the test's may sit under /root)
RING = ("import socket, sys; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)"
        ".sendto(b'', bytes.fromhex(sys.argv[1]))")


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="sends as another user: needs root and /usr/bin/python3")
def test_a_ring_from_another_user_is_read_and_not_taken() -> None:
    """Only our own user and root can be shm peers (segments are 0600): a
    ring from anyone else is read and dropped (``bells_refused``) and the
    poller sleeps on; ours wakes it."""
    import subprocess

    with shm_poller() as (poller, name, wake):
        with asleep(poller, wake) as sleeper:
            for _ in range(3):
                subprocess.run(["/usr/bin/python3", "-c", RING, name.hex()], user=65534,
                               group=65534, check=True, timeout=30, env={})
            deadline = time.monotonic() + 10
            while poller.bells_refused < 3:
                assert time.monotonic() < deadline, "the foreign rings were never read"
                time.sleep(0.001)
            assert poller.bells == 0
            assert sleeper.is_alive(), "a foreign ring ended the poller's wait"
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(b"", name)
            deadline = time.monotonic() + 10
            while poller.bells == 0:
                assert time.monotonic() < deadline, "our own ring was not taken"
                time.sleep(0.001)
        assert poller.bells == 1 and poller.bells_refused == 3


def in_poll(tid: int) -> bool:
    """Thread ``tid`` of this process sleeps in ppoll (its kernel wait
    channel says so)."""
    try:
        with open(f"/proc/self/task/{tid}/wchan") as f:
            return "poll" in f.read()
    except OSError:
        return False


async def test_a_peer_without_a_doorbell_is_written_to_as_before() -> None:
    """A bell nobody listens on (an older p2pxfer, another network namespace,
    a name someone else took): ringing fails silently, writes go on."""
    src = np.arange(SIZE, dtype=np.uint8)
    region = np.zeros(SIZE, np.uint8)
    async with pair("shm") as (a, b):
        desc = b.export(region, "r")
        a.register(src)
        # Test-only reach: a's bell for b rings a name nobody listens on.
        rail = a.shards[0]._group.rails[0]
        address = b.shards[0]._group.rails[0].address
        bell = Bells().of(b"fi_shm://nobody-listens")
        rail._bells._bells[address] = bell
        heard = b.shards[0]._poller.bells
        with trio.fail_after(WITHIN_S):
            for k in range(3):
                await a.write(src, desc, ScatterList.contiguous(64 << 10, k << 16, k << 16),
                              imm=3)
            await b.wait_imm(3, 3)
        assert rail._bells._bells[address] is bell  # the one the writes rang
        assert bell.rings == 0 and rail.rings == 0
        assert b.shards[0]._poller.bells == heard
    np.testing.assert_array_equal(region[:3 << 16], src[:3 << 16])


def test_a_name_taken_leaves_the_rail_without_a_doorbell() -> None:
    """Someone bound the name first: no doorbell (logged); the rail naps as
    before."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as squatter:
        squatter.bind(bell_name(b"fi_shm://squatted"))
        bell = Doorbell(b"fi_shm://squatted")
        assert bell.fd == -1
        bell.close()
