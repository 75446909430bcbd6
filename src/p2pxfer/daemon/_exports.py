"""This daemon's exports: one record per exported region, in one registry.

An ``Export`` is everything known of one region a client exported: its
owner, the memory behind it (the owner's shared memory, and the export's
own mapping of its range, which the engine registers), its immediate slot,
its descriptor, the other uids it lets write into it, and the same-daemon
copies running into it. ``Exports`` is the only place one is added or
removed, and it fans each change out, in one order, to the parts that act on
exports: the immediate table (the slot), the engine (registration and key),
and the parts that subscribed with ``on_remove`` (the region directory tells
the peers that resolved it; a KV pool on it ends its requests). Name
uniqueness and the writer's uid rule are checked here, once. A region
unexported with a reason leaves a tombstone for ``WITHDRAWN_KEEP_S`` (at
most ``MAX_WITHDRAWN``, the oldest dropped first): a writer that comes
late hears ``RegionWithdrawn`` and why, not ``UnknownRegion``, and stops
waiting for the region to appear.

Every method runs in the daemon's trio thread, which owns this state.
What must not live here: the copies themselves (``_local``), what peers
resolved (``_regions``), a client's memory and its other requests
(``_sessions``), the engine's registrations (``p2pxfer.engine``).
"""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import trio

from p2pxfer._pump import bounded
from p2pxfer.engine import Engine
from p2pxfer.errors import (
    InvalidArgument,
    NameTaken,
    P2PXferError,
    RegionWithdrawn,
    UnknownRegion,
)
from p2pxfer.log import get_logger
from p2pxfer.memory import RegionDescriptor

if TYPE_CHECKING:
    from ._device import DeviceExportMap, DeviceShare
    from ._imms import ImmTable, Sink
    from ._shared import ExportMap, SharedMap

__all__ = ["MAX_WITHDRAWN", "MAX_WITHDRAWN_PER_UID", "RESERVED", "WITHDRAWN_KEEP_S", "Export",
           "ExportOwner", "Exports"]

log = get_logger("p2pxfer.daemon")

#: the scratch region ``ping`` writes into, exported by the daemon itself
RESERVED = "p2pxfer.ping"
#: how long a region withdrawn with a reason is answered as such: longer
#: than a writer waits for a region to appear (the vLLM decode's pull
#: waits ``load_timeout_s``, 120 s by default)
WITHDRAWN_KEEP_S = 600.0
#: how long an unexported region's keys keep taking writes, into private
#: pages (``Engine.unexport_later``): longer than a write that was already on
#: its way takes to arrive (tcp retransmits across a short cut included)
KEY_LINGER_S = 10.0
#: at most this many unexported regions' keys linger (the oldest closed
#: first); the ranges they write into are held longer (``_retire.HOLD_S``)
MAX_LINGERING = 1024
#: tombstones kept at most; one takes a name and a reason (bounded) ...
MAX_WITHDRAWN = 4096
#: ... and of one uid's regions: past it, that uid's oldest goes, so no uid
#: can flush the others' (``withdraw`` needs no export)
MAX_WITHDRAWN_PER_UID = 1024


class ExportOwner(Protocol):
    """What the registry needs of a client that exports (``ClientSession``)."""

    label: str
    uid: int
    released: trio.Event

    def hung_up(self) -> bool: ...


@dataclass(eq=False)
class Export:
    """One exported region of one client of this daemon."""

    name: str
    owner: ExportOwner
    mem: SharedMap | DeviceShare  # the owner's memory behind it
    offset: int  # of the region in ``mem``
    #: the export's own mapping of its range (retired when it goes); device
    #: memory's is the memory itself (``_device``)
    own: ExportMap | DeviceExportMap
    slot: int  # its immediate slot, tag included (``ImmTable.allocate``)
    desc: RegionDescriptor
    writers: frozenset[int]  # other uids its owner lets write into it from this node
    #: same-daemon copies running into it (``_local``): stopped before it goes
    copies: set[Any] = field(default_factory=set)

    @property
    def length(self) -> int:
        return self.desc.length

    def admits(self, uid: int, privileged: bool) -> bool:
        """Whether a client of ``uid`` may write into it from this node."""
        return privileged or uid == self.owner.uid or uid in self.writers


@dataclass(frozen=True)
class _Withdrawn:
    """What is left of a region its owner withdrew saying why."""

    reason: str
    until: float  # trio time
    uid: int  # its owner's, and the uids it admitted
    writers: frozenset[int]

    def admits(self, uid: int, privileged: bool) -> bool:
        return privileged or uid == self.uid or uid in self.writers


class Exports:
    """Every export of this daemon's clients, by name and by owner."""

    def __init__(self, node: str, engine: Engine, imm_slots: Callable[[], ImmTable]) -> None:
        self.node = node
        self._engine = engine
        self._imm_slots = imm_slots
        self._by_name: dict[str, Export] = {}
        self._by_owner: dict[ExportOwner, dict[str, Export]] = {}
        #: tombstones by name, oldest first (insertion order), and how many
        #: each uid has
        self._withdrawn: dict[str, _Withdrawn] = {}
        self._withdrawn_by_uid: Counter[int] = Counter()
        #: called with each export as it goes, in order, after the copies into
        #: it stopped and before its slot and key are given up
        self.on_remove: list[Callable[[Export], None]] = []
        #: awaited with the name of each export as it goes, after ``on_remove``
        #: (each bounded: the region directory waits a while for the peers
        #: that resolved it to hear)
        self.settle_remove: list[Callable[[str], Awaitable[None]]] = []
        #: unexported regions whose keys still take (late) writes into private
        #: pages: (close after, name, what closes its keys, what drops the
        #: pages they dirtied), oldest first
        self._lingering: deque[tuple[float, str, Callable[[], None], Callable[[], None]]] = \
            deque()
        self._lingering_added = trio.Event()
        self._reaping = False  # ``close_lingering`` runs: keys may linger

    def get(self, name: str) -> Export | None:
        return self._by_name.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[Export]:
        return iter(sorted(self._by_name.values(), key=lambda e: e.name))

    def __len__(self) -> int:
        return len(self._by_name)

    def owned_by(self, owner: ExportOwner) -> dict[str, Export]:
        """``owner``'s exports by name (a view: do not change it)."""
        return self._by_owner.get(owner, {})

    def absent(self, name: str, uid: int | None = None, privileged: bool = False
               ) -> UnknownRegion:
        """The error for a write into ``name``, not exported here:
        ``RegionWithdrawn`` with its owner's reason while its tombstone
        lasts (to a peer, or a local ``uid`` the region admitted), else
        ``UnknownRegion``."""
        shown = bounded(name, 100)
        gone = self._withdrawn.get(name)
        if gone is not None and gone.until <= trio.current_time():
            self._unbury(name)
            gone = None
        if gone is not None and (uid is None or gone.admits(uid, privileged)):
            return RegionWithdrawn(f"region {shown!r} on {self.node} was withdrawn by its "
                                   f"owner: {gone.reason}")
        return UnknownRegion(f"no region named {shown!r} on {self.node}")

    def check_free(self, name: str) -> None:
        if not name:
            raise InvalidArgument("region name must not be empty")
        if name in self._by_name:
            raise NameTaken(f"a region named {name!r} is already exported on {self.node}")
        if name == RESERVED:
            raise NameTaken(f"the region name {name!r} is the daemon's own (p2pxfer ping)")

    def check_writer(self, name: str, uid: int, privileged: bool, writer: str) -> None:
        """A region of this daemon takes writes only from its owner's uid,
        the uids its owner granted (``writers``), or a privileged one:
        ``UnknownRegion`` otherwise, as if it did not exist, so another uid
        learns nothing of what is exported here. (Isolation is per uid, not
        per client: processes of one uid can already write each other's
        memory through ptrace or /proc/PID/mem.) A name not exported passes:
        the write path says so, after checking the rest."""
        export = self._by_name.get(name)
        if export is not None and not export.admits(uid, privileged):
            log.warning("client.write_refused", client=writer, uid=uid,
                        region=bounded(name, 100), owner=export.owner.label)
            raise UnknownRegion(f"no region named {bounded(name, 100)!r} on {self.node} that "
                                f"uid {uid} may write into")

    async def freed(self, name: str, asker: ExportOwner, wait_s: float) -> None:
        """If an owner other than ``asker`` that has hung up still holds
        ``name``, wait (up to ``wait_s``) for its session to release it, so
        a client that replaces another under the same name is not told
        ``name_taken`` for the moment the daemon takes to notice."""
        export = self._by_name.get(name)
        if export is not None and export.owner is not asker and export.owner.hung_up():
            with trio.move_on_after(wait_s):
                await export.owner.released.wait()

    def add(self, owner: ExportOwner, name: str, mem: SharedMap | DeviceShare, offset: int,
            length: int,
            writers: frozenset[int], sink: Sink) -> Export:
        """Export ``mem[offset:offset + length]`` as ``name``: its own
        mapping, an immediate slot routed to ``sink``, the engine's key
        (the caller checked ``check_free`` first, before the client's caps).
        Nothing is left behind if a step fails."""
        own = mem.export_map(offset, length)
        slots = self._imm_slots()
        try:
            slot = slots.allocate(sink)
            try:
                desc = self._engine.export(own.view, name)
            except BaseException:
                slots.free(slot)
                raise
        except BaseException:
            own.retire()
            raise
        export = Export(name, owner, mem, offset, own, slot, desc, writers)
        self._unbury(name)
        self._by_name[name] = export
        self._by_owner.setdefault(owner, {})[name] = export
        log.info("region.exported", client=owner.label, region=name, nbytes=desc.length,
                 writers=sorted(writers))
        return export

    async def remove(self, name: str, reason: str | None = None) -> None:
        """Unexport ``name``: no new copy into it from now on; the running
        ones are stopped and waited for (shielded: bounded by the pieces in
        hand, and an export must never go while a copy still writes into
        it); then the subscribers hear it (the peers that resolved it are
        told, and waited for a while: ``settle_remove``), its slot goes, and its mapping
        is retired (private pages replace the owner's): once this returns
        no byte lands in the owner's memory. Its keys close
        ``KEY_LINGER_S`` later (``close_lingering``): a peer's write still
        on its way or streaming in lands in the private pages. With
        ``reason``, a tombstone says so to later writers (``absent``)."""
        export = self._by_name.pop(name, None)
        if export is None:
            raise UnknownRegion(f"no region named {bounded(name, 100)!r} is exported here")
        if reason is not None:
            self.withdraw(name, reason, export.owner.uid, export.writers)
        mine = self._by_owner[export.owner]
        del mine[name]
        if not mine:
            del self._by_owner[export.owner]
        copies = list(export.copies)
        for c in copies:
            c.stop.set()
        with trio.CancelScope(shield=True):
            for c in copies:
                await c.done.wait()
        for hook in self.on_remove:
            try:
                hook(export)
            except Exception as exc:  # the export must still go, whatever a part says
                log.error("region.unexport_hook_failed", region=name, hook=repr(hook),
                          error=bounded(str(exc)))
        # Its keys stay open a while (where the provider copies into virtual
        # addresses), over the private pages its retired mapping leaves: a
        # peer's write already on its way lands there instead of meeting a
        # closed key, which makes tcp drop the connection and every write
        # queued behind it (``Engine.unexport_later``). The name is free at
        # once (a new export may take it while the peers are told).
        close = None
        if self._reaping:
            close = self._engine.unexport_later(name)
        else:
            self._engine.unexport(name)
        try:
            with trio.CancelScope(shield=True):  # bounded by each
                for settle in self.settle_remove:
                    await settle(name)
            self._imm_slots().free(export.slot)
            if export.own.registered_apart:
                with contextlib.suppress(P2PXferError):
                    self._engine.deregister(export.own.view)  # the registration it pinned
            retired = export.own.retire()
        finally:
            if close is not None:
                own = export.own
                self._lingering.append((trio.current_time() + KEY_LINGER_S, name, close,
                                        own.discard))
                self._lingering_added.set()
        # Keys over a range that could not be kept mapped close now.
        self._close_lingering(trio.current_time(), newest=not retired)

    def _close_lingering(self, now: float, everything: bool = False,
                         newest: bool = False) -> None:
        if newest and self._lingering:
            self._close_keys(*self._lingering.pop()[1:])
        while self._lingering and (everything or self._lingering[0][0] <= now
                                   or len(self._lingering) > MAX_LINGERING):
            self._close_keys(*self._lingering.popleft()[1:])

    def _close_keys(self, name: str, close: Callable[[], None],
                    discard: Callable[[], None]) -> None:
        try:
            close()
        except P2PXferError as exc:  # the engine closing: its rails close them
            log.warning("region.keys_close_failed", region=name, error=bounded(str(exc)))
        discard()

    @property
    def lingering(self) -> int:
        """Unexported regions whose keys still take writes (into private pages)."""
        return len(self._lingering)

    async def close_lingering(self) -> None:
        """Close unexported regions' keys once they have lingered
        ``KEY_LINGER_S``, for as long as the daemon runs (a task of its
        nursery); every one still open when it is cancelled."""
        self._reaping = True
        try:
            while True:
                if not self._lingering:
                    self._lingering_added = trio.Event()
                    await self._lingering_added.wait()
                    continue
                await trio.sleep_until(self._lingering[0][0])
                self._close_lingering(trio.current_time())
        finally:
            self._reaping = False
            self._close_lingering(trio.current_time(), everything=True)

    def withdraw(self, name: str, reason: str, uid: int, writers: frozenset[int]) -> None:
        """Leave a tombstone for ``name`` (``absent``), which was exported by
        ``uid`` for ``writers``; the oldest go past ``MAX_WITHDRAWN``, and
        ``uid``'s oldest past ``MAX_WITHDRAWN_PER_UID``."""
        self._unbury(name)  # to the end: the newest
        if self._withdrawn_by_uid[uid] >= MAX_WITHDRAWN_PER_UID:
            self._unbury(next(n for n, g in self._withdrawn.items() if g.uid == uid))
        now = trio.current_time()
        self._withdrawn[name] = _Withdrawn(reason, now + WITHDRAWN_KEEP_S, uid, writers)
        self._withdrawn_by_uid[uid] += 1
        while self._withdrawn:
            oldest = next(iter(self._withdrawn))
            if len(self._withdrawn) <= MAX_WITHDRAWN and self._withdrawn[oldest].until > now:
                break
            self._unbury(oldest)

    def _unbury(self, name: str) -> None:
        gone = self._withdrawn.pop(name, None)
        if gone is not None:
            self._withdrawn_by_uid[gone.uid] -= 1
            if not self._withdrawn_by_uid[gone.uid]:
                del self._withdrawn_by_uid[gone.uid]

    def backing(self, owner: ExportOwner, mem_id: int) -> bool:
        """Whether one of ``owner``'s exports lies in its memory ``mem_id``."""
        return any(e.mem.id == mem_id for e in self.owned_by(owner).values())
