"""The C-to-C reference: what the provider does with C at both ends.

``ReferenceTarget`` is a second (spawned) process that opens rails, exports a
zeroed region and, per request, spends its time inside one C call that
busy-polls its CQ until the expected arrivals landed (``reference_target``),
or answers a ping-pong. ``ReferenceInitiator`` writes from this process with
``reference_write``, one thread per rail (the call releases the GIL). Python
around the C calls only opens rails, exchanges addresses and keys, and times.
Every bench ratio is ours against this, as fabtests' ``fi_rma_bw`` measures.

Where no C target can run at the other end (``--client`` against a remote
bench server, ``--via-daemon``), the same initiator writes into our own target
instead, and the result says so (``reference = "c-initiator"``): that one
measures our target as well as the provider.

What must not live here: the engine, ``Transport``, option parsing, rendering.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from p2pxfer.errors import P2PXferError
from p2pxfer.fabric import (
    ACCESS_REMOTE_WRITE,
    ACCESS_WRITE,
    FabricInfo,
    MemoryRegion,
    Rail,
    getinfo,
)
from p2pxfer.memory import RailDescriptor, RegionDescriptor, buffer_span
from p2pxfer.scatter import ScatterList

from ._loops import reference_pingpong, reference_target, reference_write, writes_of
from ._options import BenchError

__all__ = ["C_INITIATOR", "C_TO_C", "RefStripe", "ReferenceInitiator", "ReferenceTarget",
           "close_rails", "open_rails", "process_cpu_seconds"]

#: ``BenchResult.reference`` values: C at both ends, or the C initiator into our target.
C_TO_C = "c-to-c"
C_INITIATOR = "c-initiator"
START_TIMEOUT = 60.0


def process_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (all its threads); this one by default."""
    if pid is None or pid == os.getpid():
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_rails(provider: str, node: str | None, names: tuple[str, ...]) -> list[Rail]:
    """One rail per named interface, in that order. (Picks from one
    ``getinfo`` by domain name: the provider may ignore a domain hint, as tcp
    does, and hand back its first interface for every name.)"""
    infos: dict[str, FabricInfo] = {}
    for info in getinfo(provider, node=node):
        infos.setdefault(info.domain_name, info)
    missing = [n for n in names if n not in infos]
    if missing:
        raise BenchError(f"{provider} has no interface {', '.join(missing)} "
                         f"(found: {', '.join(infos)})")
    rails: list[Rail] = []
    try:
        for n in names:
            rails.append(Rail(infos[n]))
    except BaseException:
        close_rails(rails)
        raise
    return rails


def close_rails(rails: list[Rail]) -> None:
    for r in reversed(rails):
        r.close()


def _run_per_rail(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run one call per rail, each in its own thread when there are several."""
    if len(calls) == 1:
        return [calls[0]()]
    out: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return out


def _register(rails: list[Rail], buf: npt.NDArray[np.uint8], access: int) -> list[MemoryRegion]:
    address = buffer_span(buf).address
    return [r.register(address, buf.nbytes, access) for r in rails]


@dataclass(frozen=True)
class RefStripe:
    """One rail's share of a round: contiguous pieces, copied out once."""

    rail: int
    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    length: npt.NDArray[np.int64]
    nbytes: int


class ReferenceInitiator:
    """``reference_write`` over rails opened here, into ``dst`` (a C target's
    region or our own)."""

    def __init__(self, rails: list[Rail], src: npt.NDArray[np.uint8],
                 dst: RegionDescriptor) -> None:
        self.rails = rails[:min(len(rails), len(dst.rails))]
        self.dst = dst
        self.src = src
        # Remote write too: a ping-pong target writes back into this buffer.
        self.mrs = _register(self.rails, src, ACCESS_WRITE | ACCESS_REMOTE_WRITE)
        self.address = buffer_span(src).address
        self.dest = [r.peer(d.address) for r, d in zip(self.rails, dst.rails, strict=False)]
        self.max_msg = min(r.info.max_msg_size for r in self.rails)

    @property
    def nrails(self) -> int:
        return len(self.rails)

    @property
    def rail_names(self) -> list[str]:
        return [r.name for r in self.rails]

    def descriptor(self) -> RegionDescriptor:
        """This side's buffer, for a ping-pong partner to write back into."""
        return RegionDescriptor("reference-initiator", self.src.nbytes, tuple(
            RailDescriptor(r.provider, r.address, mr.key, mr.base)
            for r, mr in zip(self.rails, self.mrs, strict=True)))

    def plan(self, sl: ScatterList) -> list[RefStripe]:
        """Split pieces the provider cannot take whole and, with several rails,
        give each a contiguous range of about equal bytes (as the engine does)."""
        sl.check_bounds(self.src.nbytes, self.dst.length)
        split, ranges = sl.stripe(self.nrails, self.max_msg)
        return [RefStripe(r, split.src[s:e].copy(), split.dst[s:e].copy(),
                          split.length[s:e].copy(), int(split.length[s:e].sum()))
                for r, (s, e) in enumerate(ranges) if e > s]

    def round(self, plan: list[RefStripe], imm: int | None, timeout: float) -> int:
        """Post a planned round and wait for all of it here; returns the
        writes it made (``writes``: with ``imm``, what a target counts)."""
        def post(s: RefStripe) -> Callable[[], None]:
            rd, mr = self.dst.rails[s.rail], self.mrs[s.rail]
            return lambda: reference_write(self.rails[s.rail], self.dest[s.rail], s.src, s.dst,
                                           s.length, self.address, mr.desc, rd.base, rd.key,
                                           imm, timeout)

        _run_per_rail([post(s) for s in plan])
        return sum(self.writes(s.rail, len(s.length)) for s in plan)

    def writes(self, rail: int, pieces: int) -> int:
        """The writes ``round`` makes of ``pieces`` on rail ``rail``, each
        carrying the immediate: what the C target counts."""
        return writes_of(self.rails[rail], pieces)

    def pingpong(self, length: int, iters: int, timeout: float) -> npt.NDArray[np.int64]:
        """Round trips (ns) of one ``length``-byte write each way on rail 0."""
        rd, mr = self.dst.rails[0], self.mrs[0]
        return reference_pingpong(self.rails[0], self.dest[0], self.address, mr.desc, rd.base,
                                  rd.key, length, iters, True, timeout)

    def close(self) -> None:
        for r, mr in zip(self.rails, self.mrs, strict=True):
            r.deregister(mr)


# -- the target process ----------------------------------------------------------


def _target_main(conn: Any, provider: str, node: str | None, names: tuple[str, ...],
                 size: int) -> None:
    """Entry point of the reference target process: serves requests on ``conn``."""
    try:
        rails = open_rails(provider, node, names)
        try:
            region = np.zeros(size, np.uint8)
            region.fill(0)  # fault the pages in now, not during the first round
            mrs = _register(rails, region, ACCESS_REMOTE_WRITE | ACCESS_WRITE)
            desc = RegionDescriptor("reference", size, tuple(
                RailDescriptor(r.provider, r.address, mr.key, mr.base)
                for r, mr in zip(rails, mrs, strict=True)))
            conn.send(("ready", desc.to_bytes()))
            while True:
                msg = conn.recv()
                if msg[0] == "stop":
                    conn.send(("stopped",))
                    return
                cpu0 = time.process_time()
                if msg[0] == "expect":
                    _, counts, timeout = msg
                    got = _run_per_rail([
                        partial(reference_target, rails[r], n, timeout)
                        for r, n in enumerate(counts) if n > 0])
                    conn.send(("got", got, time.process_time() - cpu0))
                elif msg[0] == "pong":
                    _, length, iters, peer_bytes, timeout = msg
                    peer = RegionDescriptor.from_bytes(peer_bytes).rails[0]
                    address = buffer_span(region).address
                    reference_pingpong(rails[0], rails[0].peer(peer.address), address,
                                       mrs[0].desc, peer.base, peer.key, length, iters, False,
                                       timeout)
                    conn.send(("ponged", time.process_time() - cpu0))
                else:
                    conn.send(("error", f"unknown request {msg[0]!r}"))
        finally:
            close_rails(rails)
    except BaseException as exc:  # tell the parent instead of dying silently
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


class ReferenceTarget:
    """A C target in a second (spawned) process on this host.

    ``expect(counts)`` starts it busy-polling (one C call per rail) until that
    many writes with immediate data landed on each rail; ``collect()`` waits
    for the verdict and returns the target's CPU seconds meanwhile."""

    def __init__(self, provider: str, node: str | None, names: tuple[str, ...],
                 size: int) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_target_main, args=(child, provider, node, names, size),
                                 daemon=True, name="p2pxfer-reference-target")
        self._proc.start()
        self._expected: list[int] | None = None
        try:
            msg = self._recv(START_TIMEOUT, "start")
            if msg[0] != "ready":
                raise BenchError(f"the reference target answered {msg[0]!r}")
            self.descriptor = RegionDescriptor.from_bytes(msg[1])
        except BaseException:
            self.close()
            raise

    def _recv(self, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                raise BenchError(f"the reference target exited (code {self._proc.exitcode}) "
                                 f"during {what}")
            if time.monotonic() > deadline:
                raise BenchError(f"the reference target did not finish {what} within "
                                 f"{timeout:g} s")
        msg = self._conn.recv()
        if msg[0] == "error":
            raise BenchError(f"the reference target failed during {what}: {msg[1]}")
        return msg

    def expect(self, counts: list[int], timeout: float) -> None:
        self._expected = list(counts)
        self._conn.send(("expect", self._expected, timeout))

    def collect(self, timeout: float) -> float:
        """Wait for the arrivals ``expect`` named; returns the target's CPU seconds."""
        if self._expected is None:
            raise BenchError("collect() without expect()")
        want = [n for n in self._expected if n > 0]
        self._expected = None
        msg = self._recv(timeout + 10, "a round")
        if list(msg[1]) != want:
            raise BenchError(f"the reference target saw {msg[1]} writes land, expected {want}")
        return float(msg[2])

    def pong(self, length: int, iters: int, peer: RegionDescriptor, timeout: float) -> None:
        self._conn.send(("pong", length, iters, peer.to_bytes(), timeout))

    def pong_done(self, timeout: float) -> float:
        return float(self._recv(timeout + 10, "the ping-pong")[1])

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop",))
                self._proc.join(10)
            except (OSError, P2PXferError):
                pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    def __enter__(self) -> ReferenceTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
