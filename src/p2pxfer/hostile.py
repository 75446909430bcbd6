"""Writes in a loop on a hostile network, every one verified: the machinery
of the loss, abandoned-write and soak tests (``tests/daemon/test_hostile_netns.py``)
and of ``bench/soak.py``.

- ``rail_daemons``: one daemon per host (anything with ``exec_argv``,
  ``interfaces`` and ``addresses``, e.g. ``tests/netns.py``'s ``Host``),
  striping over every interface of its host, each the others' static peer,
  control on the host's first address.
- ``run_loop``: a *loop* in a process of its own (spawned, so a write that
  never ends can be killed): a target client exports a region on one daemon,
  a writer client on another writes random scatter lists (fresh random bytes
  each round) into it; after every write the target waits for the pieces'
  immediates and compares the *whole* region with what it must hold. A write
  that fails may have landed partly (inside its own ranges, old or new
  bytes; nothing may change outside them); an ok write whose pieces do not
  all arrive in time is ``incomplete`` (its missing bytes may still come,
  until a newer write covers their place). Bytes of a failed or incomplete
  write that land later over a newer write, or after the failure was
  reported, count as ``late``; bytes nobody wrote there as ``corrupt``. A
  write that takes longer than its deadline plus a margin is ``hung``
  (reported if it ends at all; the loop is killed if it does not end within
  a hard bound).
- the soak (a flapping link under a loop, the daemons sampled) is
  ``p2pxfer.soak``.

What must not live here: anything the daemon runs, or namespace set-up
(``tests/netns.py``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from p2pxfer.log import get_logger
from p2pxfer.testing import DaemonProc, LaunchError, scatter_at_random, spawn_daemon

__all__ = ["HostLike", "LoopReport", "LoopSpec", "rail_daemons", "run_loop"]

log = get_logger("p2pxfer.hostile")

REGION_NAME = "hostile"
START_TIMEOUT = 60.0  # the loop's clients connected, region exported
Image = npt.NDArray[np.uint8]


class HostLike(Protocol):
    interfaces: tuple[str, ...]
    addresses: tuple[str, ...]

    def exec_argv(self, argv: Sequence[str]) -> list[str]: ...


@contextlib.contextmanager
def rail_daemons(workdir: Path, hosts: Sequence[HostLike], *, port: int = 7730,
                 token: str = "hostile-network-token",
                 **keys: Any) -> Iterator[list[DaemonProc]]:
    """A daemon ``h<i>`` in each of ``hosts``, striping over all its
    interfaces (``interfaces = [...]``), the others its static peers; more
    config ``keys`` (e.g. ``write_timeout_s``). Stopped on the way out."""
    names = [f"h{i}" for i in range(len(hosts))]
    procs: list[DaemonProc] = []
    try:
        for i, host in enumerate(hosts):
            peers = [{"name": names[j], "address": f"{h.addresses[0]}:{port}"}
                     for j, h in enumerate(hosts) if j != i]
            procs.append(spawn_daemon(workdir, {
                "node": names[i], "socket": str(workdir / f"{names[i]}.sock"),
                "control": f"{host.addresses[0]}:{port}", "provider": "tcp;ofi_rxm",
                "interfaces": list(host.interfaces), "log_level": "INFO",
                "cluster_token": token, "peers": peers, **keys,
            }, host.exec_argv))
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()


@dataclass(frozen=True)
class LoopSpec:
    """What a loop writes, from where to where, and for how long."""

    writer_socket: str
    target_socket: str
    #: the target daemon's node name (the writer's peer)
    peer: str
    #: the writer's daemon's ``write_timeout_s``: a write must end within it
    deadline_s: float
    #: rounds to run (0: until ``seconds`` have passed)
    rounds: int = 0
    seconds: float = 0.0
    region: int = 16 << 20
    pieces: tuple[int, int] = (32, 192)
    piece_bytes: tuple[int, int] = (4 << 10, 64 << 10)
    seed: int = 1
    #: a write ending later than ``deadline_s + margin_s`` is hung (the
    #: margin covers the teardown and the daemon's look-up of the region
    #: afresh after a failure: up to 5 s when the peer does not answer)
    margin_s: float = 10.0
    #: how long the target waits for an ok write's pieces to arrive
    imm_wait_s: float = 30.0
    #: after a failed write, how long before the region is read back
    settle_s: float = 0.5


def _random_write(rng: np.random.Generator, spec: LoopSpec
                  ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64],
                             npt.NDArray[np.int64]]:
    """Pieces of random lengths at random, non-overlapping places of the
    region (in random order), packed in the source in another random order."""
    n = int(rng.integers(spec.pieces[0], spec.pieces[1] + 1))
    length = rng.integers(spec.piece_bytes[0], spec.piece_bytes[1] + 1, n, dtype=np.int64)
    length = length[np.cumsum(length) <= spec.region * 3 // 4]
    return scatter_at_random(rng, length, spec.region)


class _Ledger:
    """What the region must hold, and what may still change in it: bytes of
    ok writes that had not arrived when checked (``pending``: they may still
    land, unless a newer write covered their place since) and bytes of the
    last ``LATE_KEPT`` failed or incomplete writes (``late``: landing now is
    after the failure was reported, or over a newer write)."""

    LATE_KEPT = 16

    def __init__(self, size: int) -> None:
        self.expected = np.zeros(size, np.uint8)
        self.pending, self.pending_mask = np.zeros(size, np.uint8), np.zeros(size, bool)
        #: (sorted places, their bytes) of each write that may land late
        self.late: deque[tuple[npt.NDArray[np.int64], Image]] = deque(maxlen=self.LATE_KEPT)

    def covered(self, mask: npt.NDArray[np.bool_]) -> None:
        """A newer write covers ``mask``: an older one landing there now is stale."""
        self.pending_mask &= ~mask

    def check(self, got: Image, want: Image, ignore: npt.NDArray[np.bool_] | None = None
              ) -> dict[str, Any]:
        """Compare ``got`` with ``want`` (except where ``ignore``): bytes of
        pending writes that arrived (fine), bytes of failed ones (late), bytes
        of nobody's (corrupt, with the first places)."""
        bad = got != want
        if ignore is not None:
            bad &= ~ignore
        where = np.flatnonzero(bad)
        arrived = self.pending_mask[where] & (got[where] == self.pending[where])
        self.pending_mask[where[arrived]] = False
        rest = where[~arrived]
        late = np.zeros(len(rest), bool)
        for places, values in self.late:
            at = np.minimum(np.searchsorted(places, rest), len(places) - 1)
            late |= (places[at] == rest) & (values[at] == got[rest])
        return {"arrived_late": int(arrived.sum()), "late": int(late.sum()),
                "corrupt": int((~late).sum()), "corrupt_at": rest[~late][:5].tolist()}

    def may_land(self, after: Image, mask: npt.NDArray[np.bool_], *, pending: bool) -> None:
        """Bytes of a write (``after`` where ``mask``) that may still arrive:
        fine while nothing newer covers them (``pending``), late after."""
        if pending:
            self.pending[mask] = after[mask]
            self.pending_mask |= mask
        places = np.flatnonzero(mask)
        if places.size:
            self.late.append((places, after[places]))


def _child(spec: LoopSpec, conn: Connection) -> None:
    """The loop's process: run it, report each round over ``conn``."""
    import trio

    try:
        trio.run(_loop, spec, conn)
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None


async def _loop(spec: LoopSpec, conn: Connection) -> None:
    import trio

    from p2pxfer.client import connect
    from p2pxfer.errors import P2PXferError, WaitTimeout
    from p2pxfer.scatter import ScatterList

    rng = np.random.default_rng(spec.seed)
    async with connect(spec.target_socket) as target, connect(spec.writer_socket) as writer:
        region = await target.alloc(spec.region, "hostile-region")
        await target.export(REGION_NAME, region)
        src_mem = await writer.alloc(spec.region, "hostile-source")
        ledger = _Ledger(spec.region)
        conn.send(("ready", {}))
        start = time.monotonic()
        rnd = 0
        while (rnd < spec.rounds) if spec.rounds else (time.monotonic() - start < spec.seconds):
            rnd += 1
            src, dst, length = _random_write(rng, spec)
            nbytes = int(length.sum())
            src_mem.array[:nbytes] = np.frombuffer(rng.bytes(nbytes), np.uint8)
            after, mask = ledger.expected.copy(), np.zeros(spec.region, bool)
            source = src_mem.array
            for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
                after[d:d + n] = source[s:s + n]
                mask[d:d + n] = True
            ledger.covered(mask)
            rec: dict[str, Any] = {"round": rnd, "t": round(time.monotonic() - start, 3),
                                   "bytes": nbytes, "pieces": len(length)}
            t0 = time.monotonic()
            try:
                pieces = await writer.write(spec.peer, REGION_NAME,
                                            ScatterList(src, dst, length), src=src_mem, imm=rnd)
            except P2PXferError as exc:
                rec.update(outcome="failed", seconds=time.monotonic() - t0,
                           error=f"{type(exc).__name__}/{getattr(exc, 'code', '')}",
                           message=str(exc)[:300])
                await trio.sleep(spec.settle_s)
                got = region.array.copy()
                # Inside its ranges a failed write may have landed (new bytes) or not.
                rec.update(ledger.check(got, ledger.expected, mask & (got == after)))
                ledger.expected = got
                ledger.may_land(after, mask, pending=False)
            else:
                rec.update(outcome="ok", seconds=time.monotonic() - t0)
                t1 = time.monotonic()
                try:
                    await target.wait_imm(rnd, pieces, region=REGION_NAME,
                                          timeout=spec.imm_wait_s)
                except WaitTimeout as exc:
                    rec["incomplete"] = str(exc)[:300]
                rec["wait_s"] = time.monotonic() - t1
                got = region.array.copy()
                if "incomplete" in rec:
                    # Told ok, not all there yet: what is missing may still come.
                    missing = mask & (got != after) & (got == ledger.expected)
                    rec["missing"] = int(missing.sum())
                    rec.update(ledger.check(got, after, missing))
                    ledger.may_land(after, missing, pending=True)
                    ledger.expected = got
                else:
                    rec.update(ledger.check(got, after))
                    ledger.expected = got
            conn.send(("round", rec))
        conn.send(("done", {"rounds": rnd}))
        # The parent samples the daemons with the clients still connected.
        while not await trio.to_thread.run_sync(conn.poll, 1.0):
            pass


@dataclass
class LoopReport:
    """What a loop saw, round by round, and its counts."""

    spec: LoopSpec
    rounds: list[dict[str, Any]] = field(default_factory=list)
    #: why the loop was stopped early ("" if it ran to its end)
    stopped: str = ""

    @property
    def hang_after_s(self) -> float:
        return self.spec.deadline_s + self.spec.margin_s

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.rounds if r["outcome"] == "ok"]
        errors = Counter(r["error"] for r in self.rounds if r["outcome"] == "failed")
        secs = sorted(r["seconds"] for r in self.rounds)
        ok_bytes = sum(r["bytes"] for r in ok)
        # Until the pieces arrived: a write's own end can come before that.
        ok_secs = sum(r["seconds"] + r["wait_s"] for r in ok)
        hung = sum(r["seconds"] > self.hang_after_s for r in self.rounds) + bool(self.stopped)
        return {
            "writes": len(self.rounds), "ok": len(ok), "failed": sum(errors.values()),
            "failed_by_error": dict(errors), "hung": hung, "stopped": self.stopped,
            "late_bytes": sum(r["late"] for r in self.rounds),
            "arrived_late_bytes": sum(r["arrived_late"] for r in self.rounds),
            "late_writes": sum(r["late"] > 0 for r in self.rounds),
            "corrupt_bytes": sum(r["corrupt"] for r in self.rounds),
            "corrupt_writes": sum(r["corrupt"] > 0 for r in self.rounds),
            "incomplete": sum("incomplete" in r for r in self.rounds),
            "missing_bytes": sum(r.get("missing", 0) for r in self.rounds),
            "ok_mib_per_s_landed": round(ok_bytes / ok_secs / 2**20, 1) if ok_secs else 0.0,
            "write_s_median": round(secs[len(secs) // 2], 3) if secs else 0.0,
            "write_s_max": round(secs[-1], 3) if secs else 0.0,
            "hang_after_s": self.hang_after_s,
        }

    def problems(self) -> list[dict[str, Any]]:
        """Rounds that were hung, late, corrupt or incomplete."""
        return [r for r in self.rounds if r["seconds"] > self.hang_after_s or r["late"]
                or r["corrupt"] or "incomplete" in r]


def run_loop(spec: LoopSpec, *, on_round: Callable[[dict[str, Any]], None] | None = None,
             at_end: Callable[[], None] | None = None) -> LoopReport:
    """Run a loop (see the module doc) to its end; ``on_round(record)`` after
    each round, ``at_end()`` once it is done but its clients are still
    connected. A round that reports nothing within a hard bound (deadline,
    margin, the pieces' wait and a minute) stops the loop: its process is
    killed and the report says so."""
    ctx = mp.get_context("spawn")
    conn, child_end = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(spec, child_end), name="p2pxfer-hostile-loop",
                       daemon=True)
    proc.start()
    child_end.close()
    report = LoopReport(spec)
    bound = spec.deadline_s + spec.margin_s + spec.imm_wait_s + spec.settle_s + 60.0
    try:
        msg = _receive(conn, START_TIMEOUT, "the loop to start")
        while True:
            if msg[0] == "error":
                raise LaunchError(f"the write loop failed:\n{msg[1]}")
            if msg[0] == "done":
                break
            if msg[0] == "round":
                report.rounds.append(msg[1])
                if on_round is not None:
                    on_round(msg[1])
            if not conn.poll(bound):
                report.stopped = (f"round {len(report.rounds) + 1} reported nothing within "
                                  f"{bound:g} s: a hung write; the loop was killed")
                return report
            msg = conn.recv()
        if at_end is not None:
            at_end()
        conn.send(("bye",))
        proc.join(30)
        return report
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        conn.close()
        log.info("hostile.loop_done", **report.summary())


def _receive(conn: Connection, timeout: float, what: str) -> Any:
    if not conn.poll(timeout):
        raise LaunchError(f"no word from the write loop within {timeout} s waiting for {what}")
    try:
        return conn.recv()
    except EOFError:
        raise LaunchError(f"the write loop died waiting for {what}") from None
