"""The write path: one client's ``write`` from its shared memory into a region
on a peer (or on this node), on the engine; or, when a client of this same
daemon exports the region (named by this node's name, or by a peer name
whose descriptor turns out to be ours), a copy (``_local``, unless the config
says ``local_copy = false``).

The destination is resolved through the region directory (cached); with
membership on, the peer must be running and the descriptor stamped with its
running life, and a verdict of dead, left or restarted while the write runs
fails it with ``PeerLost``. A write whose transfer fails looks the region up
afresh, so the caller hears ``unknown_region`` (gone) or ``PeerLost`` (its
node died) rather than a bare transport error. What must not live here:
posting or completions (``p2pxfer.engine``), the copy itself (``_local``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import trio

from p2pxfer.errors import (
    InvalidArgument,
    NotificationUnknown,
    P2PXferError,
    PeerLost,
    PeerUnreachable,
    RegionWithdrawn,
    TransferError,
    TransferTimeout,
)
from p2pxfer.log import get_logger
from p2pxfer.memory import RegionDescriptor
from p2pxfer.scatter import ScatterList

from ._local import LocalCopies, auto_threads
from ._peers import PEER_TIMEOUT_S, deadline_after, seconds_left

if TYPE_CHECKING:
    from p2pxfer.engine import Engine

    from ._config import DaemonConfig
    from ._exports import Exports
    from ._follow import Follower
    from ._imms import ImmTable
    from ._metrics import DaemonMetrics
    from ._regions import Regions
    from ._sessions import ClientSession

__all__ = ["Writes"]

log = get_logger("p2pxfer.daemon")

#: a notification whose outcome is unknown: how long before asking its peer
#: again when its control port did not answer (the link may move to a rail
#: that answers)
SETTLE_RETRY_S = 0.5


class Writes:
    """Writes in flight, and how each one runs."""

    def __init__(self, config: DaemonConfig, engine: Engine, regions: Regions,
                 exports: Exports, follower: Follower, *, incarnation: int,
                 imm_slots: Callable[[], ImmTable],
                 metrics: Callable[[], DaemonMetrics | None]) -> None:
        self.node = config.node
        self.incarnation = incarnation
        self.write_timeout_s = config.write_timeout_s
        self.fault_notify = config.fault_notify
        self.engine = engine
        self.regions = regions
        self.exports = exports
        self.follower = follower
        self._imm_slots = imm_slots  # made on first use (``Daemon.imm_slots``)
        self._metrics = metrics  # set once the daemon serves (None: not configured)
        self.in_flight = 0
        #: notifications whose outcome was unknown, by how that ended
        self.notifications = {"landed": 0, "counted_on_ask": 0, "unknown": 0}
        threads = config.local_copy_threads or auto_threads(_node_cpus(engine))
        #: the same-daemon fast path
        self.local = LocalCopies(self.node, exports, imm_slots, enabled=config.local_copy,
                                 threads=threads)

    @property
    def imm_slots(self) -> ImmTable:
        return self._imm_slots()

    async def write(self, client: str, src: Any, scatter: ScatterList, peer: str,
                    region: str, imm: int | None, *,
                    session: ClientSession | None = None, notify: bool = False) -> int:
        """Write ``scatter`` from ``src`` into ``region`` on ``peer``, once
        all of it has landed; returns how many immediates the region's owner
        will count for it. ``imm`` is the client's value, sent with the
        region's slot (``_imms``), so only the region's owner counts it: on
        every piece (returns the pieces written), or with ``notify`` once,
        after every piece landed (returns 1; the engine's notify mode, which
        also lets the write fail over to another rail). ``session`` (the
        writer) makes a write into a region of this daemon's clients a copy
        (``_local``)."""
        if imm is not None:
            self.imm_slots.check_value(imm)
        elif notify:
            raise InvalidArgument("notify needs an imm: it is the immediate sent once the "
                                  "write landed")
        if peer == self.node and session is not None and self.local.enabled:
            return await self._copy(session, src, scatter, region, imm, notify)
        # One deadline for all of the write: asking the peer for the region
        # (or why it failed) spends the same time as posting and completing.
        until = deadline_after(self.write_timeout_s)
        follower = self.follower
        if not follower.enabled:
            desc = await self.destination(session, peer, region, until)
            return await self._run(client, src, scatter, peer, region, desc, imm, session,
                                   notify, until)
        follower.check_peer(peer)
        with follower.track_write(peer):
            desc = await self.destination(session, peer, region, until)
            try:
                follower.check_descriptor(desc)
            except PeerLost:
                self.regions.forget(peer, region)
                raise
            return await self._run(client, src, scatter, peer, region, desc, imm, session,
                                   notify, until)
        raise AssertionError("unreachable")  # track_write raised PeerLost

    def ours(self, desc: RegionDescriptor) -> bool:
        """``desc`` is a region of this daemon, in its running life."""
        return desc.node == self.node and desc.incarnation == self.incarnation

    def copies(self, desc: RegionDescriptor) -> bool:
        """A client's write (or KV push) into ``desc`` is a same-daemon copy."""
        return self.local.enabled and self.ours(desc)

    async def destination(self, session: ClientSession | None, peer: str, region: str,
                          until: float) -> RegionDescriptor:
        """``region`` on ``peer``, resolved. A region of this daemon meets the
        writer's uid check (``ClientSession.may_write_into``) whatever name
        reached it: this node's, or a peer entry whose address is our own
        control port (the check must not depend on how the peer was named).
        A region of this node withdrawn with a reason says so only to a uid
        it admitted."""
        try:
            desc = await self.regions.resolve(peer, region, until=until)
        except RegionWithdrawn:
            if session is None or peer != self.node:
                raise
            raise self.exports.absent(region, session.uid, session.privileged) from None
        if session is not None and self.ours(desc):
            session.may_write_into(desc.name)
        return desc

    @contextlib.contextmanager
    def accounted(self) -> Iterator[None]:
        """One transfer in flight (``status``' ``transfers_in_flight``) and,
        once it ends, in the write metrics: writes, same-daemon copies and
        KV pushes alike."""
        self.in_flight += 1
        t0 = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            self.in_flight -= 1
            metrics = self._metrics()
            if metrics is not None:
                metrics.observe_write(time.perf_counter() - t0, ok)

    async def _copy(self, session: ClientSession, src: Any, scatter: ScatterList,
                    region: str, imm: int | None, notify: bool) -> int:
        """A write into a region of this daemon's clients: a copy."""
        t0 = time.perf_counter()
        with self.accounted():
            pieces = await self.local.write(session, src, scatter, region, imm, notify)
        log.debug("transfer.complete", client=session.label, peer=self.node, region=region,
                  nbytes=scatter.nbytes, pieces=pieces, seconds=time.perf_counter() - t0,
                  path="local-copy")
        return pieces

    async def _run(self, client: str, src: Any, scatter: ScatterList, peer: str,
                   region: str, desc: RegionDescriptor, imm: int | None,
                   session: ClientSession | None = None, notify: bool = False,
                   until: float = math.inf) -> int:
        if session is not None and self.copies(desc):
            # ``peer`` names this daemon (an alias of ours): the same copy as a
            # write naming our own node, into the export of that name now.
            if desc.name not in self.exports:
                self.regions.forget(peer, region)
            return await self._copy(session, src, scatter, desc.name, imm, notify)
        t0 = time.perf_counter()
        with self.accounted():
            try:
                pieces = await self._post(src, desc, scatter, peer, region, imm, notify, until)
            except trio.Cancelled:
                # Given up (its client cancelled or went away), perhaps stuck
                # on a cut link, during which the region may have gone (its
                # invalidate lost): resolve afresh next time.
                self.regions.forget(peer, region)
                raise
            except TransferError as exc:
                log.warning("transfer.failed", client=client, peer=peer, region=region,
                            nbytes=scatter.nbytes, error=str(exc))
                if isinstance(exc, TransferTimeout):
                    # Its deadline has passed: asking the peer why (up to
                    # PEER_TIMEOUT_S more, a silent peer never answers) would
                    # break it. The next write resolves afresh.
                    self.regions.forget(peer, region)
                    raise
                fresh = await self._why_failed(peer, region, exc, until)
                if fresh is None or fresh.incarnation == desc.incarnation:
                    raise
                # The peer restarted since we resolved the region: nothing of
                # this write can have landed in its new life's memory, so it
                # is written once more, there.
                self.follower.check_descriptor(fresh)
                log.info("transfer.retry_new_life", client=client, peer=peer, region=region,
                         incarnation=fresh.incarnation)
                pieces = await self._post(src, fresh, scatter, peer, region, imm, notify,
                                          until)
        log.debug("transfer.complete", client=client, peer=peer, region=region,
                  nbytes=scatter.nbytes, pieces=pieces, seconds=time.perf_counter() - t0)
        return pieces

    async def _post(self, src: Any, desc: RegionDescriptor, scatter: ScatterList,
                    peer: str, region: str, imm: int | None, notify: bool,
                    until: float) -> int:
        """The write on the engine, ``imm`` sent with the region's slot. A
        notification goes through a ticket where the peer gives them
        (``_imms``): when its outcome is unknown, the peer says over the
        control connection whether it landed, and counts it if not
        (``notify_settle``): exactly once, and unknown only when that path
        fails too."""
        ticket = await self.regions.ticket_for_write(peer, region, until) \
            if notify and imm is not None else None
        prefix = ticket if ticket is not None else self.regions.slot(peer, region)
        full = None if imm is None else self.imm_slots.compose(prefix, imm)
        try:
            if notify and self.fault_notify:
                await self._faulty_notify(src, desc, scatter, full, until)
            return await self.engine.write(src, desc, scatter, imm=full, notify=notify,
                                           timeout=seconds_left(until))
        except NotificationUnknown as unknown:
            if ticket is None or imm is None:
                self.notifications["unknown"] += 1
                raise
            try:
                arrived = await self._settle(peer, ticket, imm, until)
            except P2PXferError as exc:
                self.notifications["unknown"] += 1
                log.warning("transfer.notification_unsettled", peer=peer, region=region,
                            error=str(exc))
                raise unknown from exc
            self.notifications["landed" if arrived else "counted_on_ask"] += 1
            log.info("transfer.notification_settled", peer=peer, region=region,
                     counted_on_ask=not arrived, why=str(unknown))
            return 1

    async def _settle(self, peer: str, ticket: int, imm: int, until: float) -> bool:
        """Ask ``peer`` whether the notification through ``ticket`` landed;
        asked again while the write has time, if its control port did not
        answer: the rail the link used may be the one that failed, and
        membership moves the link to a rail that answers (``reroute``).
        Asking twice is safe: the peer remembers a ticket it counted."""
        while True:
            try:
                return await self.regions.settle(peer, ticket, imm, until)
            except PeerUnreachable:
                if trio.current_time() + SETTLE_RETRY_S >= until:
                    raise
                await trio.sleep(SETTLE_RETRY_S)

    async def _faulty_notify(self, src: Any, desc: RegionDescriptor,
                             scatter: ScatterList, imm: int | None, until: float) -> None:
        """``fault_notify`` (tests): the write in notify mode, its
        notification sent through its ticket ("landed") or through slot 0,
        which nobody holds, so the target drops it ("lost"), then
        ``NotificationUnknown`` as when its rail breaks before the
        notification's ack. Either way every byte landed first, as there."""
        assert imm is not None
        if self.fault_notify == "lost":
            imm &= (1 << self.imm_slots.value_bits) - 1
        await self.engine.write(src, desc, scatter, imm=imm, notify=True,
                                timeout=seconds_left(until))
        raise NotificationUnknown(f"write to {desc.node}: every piece landed, but its "
                                  f"notification's outcome is unknown (fault_notify = "
                                  f"{self.fault_notify!r})")

    async def _why_failed(self, peer: str, region: str, failure: TransferError,
                          until: float) -> RegionDescriptor | None:
        """A transfer failed: the region (or its owner) may be gone. Look it
        up afresh (raising ``unknown_region`` if it went) and return what the
        peer says now; with membership, a peer whose daemon is unreachable
        too probably died: wait for the verdict (inside ``track_write`` it
        turns this into ``PeerLost``) and return None."""
        backend = self.follower.backend
        self.regions.forget(peer, region)
        self.follower.check_peer(peer)
        unreachable = False
        fresh = None
        # Up to PEER_TIMEOUT_S, or what is left of the write's time if more.
        until = max(until, trio.current_time() + PEER_TIMEOUT_S)
        with trio.move_on_at(until) as asking:
            try:
                fresh = await self.regions.resolve(peer, region, until=until)
            except PeerUnreachable as exc:
                if backend is None:
                    # Say what failed first, then why the peer's daemon was no help.
                    raise PeerUnreachable(f"write to {region!r} on {peer!r} failed ({failure}), "
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


def _node_cpus(engine: Any) -> tuple[int, ...]:
    """The CPUs of the engine's first shard's NUMA node (empty if unknown)."""
    shards = getattr(getattr(engine, "topology", None), "shards", ())
    return tuple(shards[0].cpus) if shards else ()
