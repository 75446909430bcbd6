"""Registrations scoped to exports: no write lands after its owner gave up.

Each ``Engine.export`` registers exactly the exported span for remote writes,
with keys of its own; ``unexport`` closes those registrations before it
returns; memory registered as a source has local access only. Two engines in
one trio run, over ``tcp;ofi_rxm`` on 127.0.0.1 and ``shm``.

What the providers here (libfabric 1.17) do with a write whose key is closed
or whose range lies outside the registration: the *target's* provider refuses
it (``ofi_mr_map_verify``: "unknown key" / "out of registered range"), the
target's memory is untouched and no immediate is counted; the connection
stays up. The initiator, though, hears nothing by default (its completion
means "sent"): only with ``EngineConfig(delivery_complete=True)`` does the
write fail there, with ``TransferError``. Both are checked below.

shm refuses such writes too, but a refused write larger than its inject size
(4 KiB) never completes at the initiator: the target drops the command
without answering, and the writer waits for ever (a known gap, see
docs/architecture.md). So shm is checked here with 4 KiB writes only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import trio

from conftest import engine_pair as pair
from p2pxfer.engine import Engine, RailGroup
from p2pxfer.errors import P2PXferError, TransferError
from p2pxfer.fabric import ACCESS_REMOTE_WRITE, Rail
from p2pxfer.loopback import loopback_node
from p2pxfer.memory import RailDescriptor, RegionDescriptor, buffer_span
from p2pxfer.scatter import ScatterList

PROVIDERS = ["tcp;ofi_rxm", "shm"]
STEP = 20.0
# How long a refused write is given to land anyway (it never should).
SETTLE = 0.5
KIB = 1024


@pytest.fixture(params=PROVIDERS)
def provider(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# (provider, bytes written through a refused registration); see the module doc for shm.
REFUSED = pytest.mark.parametrize(
    ("provider", "size"),
    [("tcp;ofi_rxm", 4 * KIB), ("tcp;ofi_rxm", 1 << 20), ("shm", 4 * KIB)],
    ids=["tcp-4KiB", "tcp-1MiB", "shm-4KiB"])


async def attempt(a: Engine, src: Any, dst: RegionDescriptor, sl: ScatterList,
                  imm: int) -> P2PXferError | None:
    """Write and return the error, if the initiator hears of one."""
    try:
        with trio.fail_after(STEP):
            await a.write(src, dst, sl, imm=imm)
    except TransferError as exc:
        return exc
    return None


async def nothing_arrives(b: Engine, imm: int) -> None:
    with trio.move_on_after(SETTLE):
        await b.wait_imm(imm, 1)
        raise AssertionError(f"a refused write delivered immediate {imm}")
    assert b.imm_count(imm) == 0


async def still_works(a: Engine, b: Engine, src: Any) -> None:
    """A fresh export between the same engines still takes writes."""
    fresh = np.zeros(64 * KIB, np.uint8)
    d = b.export(fresh, "fresh")
    with trio.fail_after(STEP):
        n = await a.write(src, d, ScatterList.contiguous(64 * KIB), imm=99)
        await b.wait_imm(99, n)
    assert (fresh == src[:64 * KIB]).all()
    b.unexport("fresh")


async def test_unexport_later_frees_the_name_and_keeps_the_keys_until_closed() -> None:
    """``unexport_later``: the name is free at once; a write through the old
    descriptor still lands (delivery-complete: its writer hears it did) until
    the returned function closes the keys, and is refused after."""
    src = np.full(64 * KIB, 0x5A, np.uint8)
    target = np.zeros(1 << 20, np.uint8)
    async with pair("tcp;ofi_rxm", delivery_complete=True) as (a, b):
        a.register(src)
        desc = b.export(target, "r")
        close = b.unexport_later("r")
        assert close is not None and "r" not in b.exported()
        b.export(np.zeros(4 * KIB, np.uint8), "r")  # taken again at once
        assert await attempt(a, src, desc, ScatterList.contiguous(4 * KIB), 1) is None
        assert (target[:4 * KIB] == 0x5A).all()
        close()
        target[:] = 0
        err = await attempt(a, src, desc, ScatterList.contiguous(4 * KIB), 2)
        assert isinstance(err, TransferError), err
        await nothing_arrives(b, 2)  # and the connection it broke is dialed again
        assert not target.any()
        b.unexport("r")
        await still_works(a, b, src)


@REFUSED
async def test_a_stale_descriptor_writes_nothing(provider: str, size: int) -> None:
    src = np.full(1 << 20, 0xA5, np.uint8)
    target = np.zeros(4 << 20, np.uint8)
    async with pair(provider) as (a, b):
        a.register(src)
        b.register(target, writable=True)  # as the daemon does with shared memory
        desc = b.export(target[1 << 20:3 << 20], "r")
        with trio.fail_after(STEP):
            n = await a.write(src, desc, ScatterList.contiguous(4 * KIB), imm=1)
            await b.wait_imm(1, n)
        target[:] = 0
        b.unexport("r")
        await attempt(a, src, desc, ScatterList.contiguous(size, dst=8 * KIB), 2)
        await nothing_arrives(b, 2)
        assert not target.any(), "a write through an unexported region's descriptor landed"
        await still_works(a, b, src)


async def test_a_stale_write_fails_at_the_initiator_with_delivery_complete() -> None:
    src = np.full(64 * KIB, 0x5A, np.uint8)
    target = np.zeros(1 << 20, np.uint8)
    async with pair("tcp;ofi_rxm", delivery_complete=True) as (a, b):
        a.register(src)
        desc = b.export(target, "r")
        with trio.fail_after(STEP):
            n = await a.write(src, desc, ScatterList.contiguous(4 * KIB), imm=1)
            await b.wait_imm(1, n)
        target[:] = 0
        b.unexport("r")
        err = await attempt(a, src, desc, ScatterList.contiguous(4 * KIB), 2)
        assert isinstance(err, TransferError), err
        assert a.statistics().failed == 1
        await nothing_arrives(b, 2)
        assert not target.any()
        await still_works(a, b, src)


@REFUSED
async def test_a_sub_range_export_cannot_be_written_outside_it(provider: str,
                                                               size: int) -> None:
    # The sender checks bounds against the descriptor, so forge one whose
    # length is enlarged: the registration itself must stop the write.
    src = np.full(1 << 20, 0x3C, np.uint8)
    target = np.zeros(4 << 20, np.uint8)
    lo, hi = 1 << 20, (1 << 20) + 256 * KIB
    async with pair(provider) as (a, b):
        a.register(src)
        b.register(target, writable=True)  # the whole buffer is registered too
        desc = b.export(target[lo:hi], "sub")
        forged = dataclasses.replace(desc, length=3 << 20)
        await attempt(a, src, forged, ScatterList.contiguous(size, dst=hi - lo + 64 * KIB), 3)
        await nothing_arrives(b, 3)
        assert not target.any(), "a write beyond the exported range landed"
        # Inside the range, the same descriptor works.
        with trio.fail_after(STEP):
            n = await a.write(src, forged, ScatterList.contiguous(4 * KIB, dst=4 * KIB), imm=4)
            await b.wait_imm(4, n)
        assert (target[lo + 4 * KIB:lo + 8 * KIB] == 0x3C).all()
        assert np.count_nonzero(target) == 4 * KIB


async def test_two_exports_of_one_buffer_have_their_own_keys(provider: str) -> None:
    src = np.full(64 * KIB, 0x11, np.uint8)
    target = np.zeros(1 << 20, np.uint8)
    async with pair(provider) as (a, b):
        a.register(src)
        first, second = b.export(target, "one"), b.export(target, "two")
        assert {r.key for r in first.rails}.isdisjoint(r.key for r in second.rails)
        b.unexport("one")
        # Closing one export leaves the other's registration alone.
        with trio.fail_after(STEP):
            n = await a.write(src, second, ScatterList.contiguous(4 * KIB), imm=5)
            await b.wait_imm(5, n)
        assert (target[:4 * KIB] == 0x11).all()
        target[:] = 0
        await attempt(a, src, first, ScatterList.contiguous(4 * KIB), 6)
        await nothing_arrives(b, 6)
        assert not target.any()


def test_a_source_registration_takes_no_remote_writes(provider: str) -> None:
    """Memory registered for sending (even ``writable=True``, as the daemon
    registers shared memory) has local access only; exports have remote
    write access only."""
    with RailGroup([Rail.open(provider, node=loopback_node(provider))]) as group:
        buf = np.zeros(64 * KIB, np.uint8)
        region = group.register(buf, writable=True)
        assert all(mr.access & ACCESS_REMOTE_WRITE == 0 for mr in region.mrs)
        group.export(buf[:4 * KIB], "e")
        (exp, _) = group._exports["e"]
        assert all(mr.access == ACCESS_REMOTE_WRITE for mr in exp.mrs)
        assert {mr.key for mr in exp.mrs}.isdisjoint(mr.key for mr in region.mrs)
        group.unexport("e")
        assert exp.closed


async def test_a_forged_descriptor_for_a_source_registration_writes_nothing(
        provider: str) -> None:
    # A peer that learnt (or guessed) the key of memory registered for
    # sending still cannot write into it: that registration has no remote access.
    src = np.full(64 * KIB, 0x77, np.uint8)
    victim = np.zeros(64 * KIB, np.uint8)
    async with pair(provider) as (a, b):
        a.register(src)
        b.register(victim, writable=True)
        (shard,) = b.shards
        region = shard.memory.lookup(buffer_span(victim))
        assert region is not None
        real = b.export(np.zeros(4 * KIB, np.uint8), "decoy")
        rails = tuple(RailDescriptor(r.provider, r.address, mr.key, mr.base)
                      for r, mr in zip(real.rails, region.mrs, strict=True))
        forged = RegionDescriptor("forged", victim.nbytes, rails)
        await attempt(a, src, forged, ScatterList.contiguous(4 * KIB), 7)
        await nothing_arrives(b, 7)
        assert not victim.any(), "a write into memory registered only for sending landed"
