"""The write path: one client's ``write`` from its shared memory into a region
on a peer (or on this node), on the engine.

The destination is resolved through the region directory (cached); with
membership on, the peer must be running and the descriptor stamped with its
running life, and a verdict of dead, left or restarted while the write runs
fails it with ``PeerLost``. A write whose transfer fails looks the region up
afresh, so the caller hears ``unknown_region`` (gone) or ``PeerLost`` (its
node died) rather than a bare transport error. What must not live here:
posting or completions (``p2pxfer.engine``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog
import trio

from p2pxfer.errors import PeerLost, RemoteClosed, TransferError
from p2pxfer.memory import RegionDescriptor
from p2pxfer.scatter import ScatterList

from ._peers import PEER_TIMEOUT_S

if TYPE_CHECKING:
    from ._daemon import Daemon

__all__ = ["Writes"]

log = structlog.get_logger("p2pxfer.daemon")


class Writes:
    """Writes in flight, and how each one runs."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.in_flight = 0

    async def write(self, client: str, src: memoryview, scatter: ScatterList, peer: str,
                    region: str, imm: int | None) -> int:
        """Write ``scatter`` from ``src`` into ``region`` on ``peer``; the
        pieces written, once all have landed. ``imm`` is the client's value:
        each piece carries it with the region's slot (``_imms``), so only
        the region's owner counts it."""
        d = self.d
        if imm is not None:
            d.imms.check_value(imm)
        follower = d.follower
        if not follower.enabled:
            desc = await d.regions.resolve(peer, region)
            return await self._run(client, src, scatter, peer, region, desc, imm)
        follower.check_peer(peer)
        with follower.track_write(peer):
            desc = await d.regions.resolve(peer, region)
            try:
                follower.check_descriptor(desc)
            except PeerLost:
                d.regions.forget(peer, region)
                raise
            return await self._run(client, src, scatter, peer, region, desc, imm)
        raise AssertionError("unreachable")  # track_write raised PeerLost

    async def _run(self, client: str, src: memoryview, scatter: ScatterList, peer: str,
                   region: str, desc: RegionDescriptor, imm: int | None) -> int:
        d = self.d
        self.in_flight += 1
        t0 = time.perf_counter()
        ok = False
        try:
            try:
                pieces = await d.engine.write(src, desc, scatter,
                                              imm=self._imm(peer, region, imm))
            except trio.Cancelled:
                # Given up (its client cancelled or went away), perhaps stuck
                # on a cut link, during which the region may have gone (its
                # invalidate lost): resolve afresh next time.
                d.regions.forget(peer, region)
                raise
            except TransferError as exc:
                log.warning("transfer.failed", client=client, peer=peer, region=region,
                            nbytes=scatter.nbytes, error=str(exc))
                fresh = await self._why_failed(peer, region, exc)
                if fresh is None or fresh.incarnation == desc.incarnation:
                    raise
                # The peer restarted since we resolved the region: nothing of
                # this write can have landed in its new life's memory, so it
                # is written once more, there.
                d.follower.check_descriptor(fresh)
                log.info("transfer.retry_new_life", client=client, peer=peer, region=region,
                         incarnation=fresh.incarnation)
                pieces = await d.engine.write(src, fresh, scatter,
                                              imm=self._imm(peer, region, imm))
            ok = True
        finally:
            self.in_flight -= 1
            if d.metrics is not None:
                d.metrics.observe_write(time.perf_counter() - t0, ok)
        log.debug("transfer.complete", client=client, peer=peer, region=region,
                  nbytes=scatter.nbytes, pieces=pieces, seconds=time.perf_counter() - t0)
        return pieces

    def _imm(self, peer: str, region: str, value: int | None) -> int | None:
        if value is None:
            return None
        return self.d.imms.compose(self.d.regions.slot(peer, region), value)

    async def _why_failed(self, peer: str, region: str,
                          failure: TransferError) -> RegionDescriptor | None:
        """A transfer failed: the region (or its owner) may be gone. Look it
        up afresh (raising ``unknown_region`` if it went) and return what the
        peer says now; with membership, a peer whose daemon is unreachable
        too probably died: wait for the verdict (inside ``track_write`` it
        turns this into ``PeerLost``) and return None."""
        d = self.d
        backend = d.follower.backend
        d.regions.forget(peer, region)
        d.follower.check_peer(peer)
        unreachable = False
        fresh = None
        with trio.move_on_after(PEER_TIMEOUT_S) as asking:
            try:
                fresh = await d.regions.resolve(peer, region)
            except RemoteClosed as exc:
                if backend is None:
                    # Say what failed first, then why the peer's daemon was no help.
                    raise RemoteClosed(f"write to {region!r} on {peer!r} failed ({failure}), "
                                       f"and {exc}") from failure
                unreachable = True
        # No answer at all (a host gone or cut off) is unreachable too.
        unreachable = unreachable or asking.cancelled_caught
        if unreachable and backend is not None:
            # Say so to membership (SWIM suspects it now, not at its next
            # failed probe) and let it rule; without a verdict in time, the
            # transport's error stands.
            backend.suspect(peer)
            await trio.sleep(backend.detection_bound())
        return fresh
