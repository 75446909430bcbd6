"""The one interface every membership backend offers the daemon.

A backend runs as background tasks in a nursery the caller gives it:

    backend = EmbeddedBackend(name, "10.0.0.1:7946", token, seeds=[...])
    await backend.start(nursery)       # returns once it is up (joined, if it could)
    async for event in backend.events():  # a subscription: MemberJoined, MemberDead...
        ...
    backend.is_current(name, incarnation)  # before trusting a descriptor
    await backend.stop()               # graceful leave; stop(graceful=False) to vanish

or as an async context manager (``async with backend: ...``), which starts it
in a nursery of its own and stops it gracefully on the way out.

What must not live here: protocol rules (``_swim*.py``) or daemon state (the
region directory, transfers): the daemon reacts to the events.
"""

from __future__ import annotations

import abc
import contextlib
from types import TracebackType
from typing import Any, Self

import trio

from p2pxfer.errors import P2PXferError, PeerLost
from p2pxfer.log import get_logger

from ._member import (
    AuthFailed,
    BadDatagram,
    Member,
    MemberDead,
    MemberDegraded,
    MemberRestarted,
    MembershipEvent,
    MemberSuspect,
    Superseded,
)

__all__ = ["MembershipBackend", "MembershipError", "PeerLost", "StaleIncarnation"]

log = get_logger("p2pxfer.membership")

#: events a subscriber may fall behind by before it is cut off
SUBSCRIBER_BUFFER = 1024


class MembershipError(P2PXferError):
    """The membership backend cannot do its job (etcd unreachable, bad address...)."""


class StaleIncarnation(PeerLost):
    """A descriptor is stamped with an incarnation that is not its node's
    running life: the node restarted (or died) since it was exported."""


class MembershipBackend(abc.ABC):
    """Who is in the cluster, kept current in the background."""

    def __init__(self, name: str, incarnation: int) -> None:
        self.name = name
        self.incarnation = incarnation
        self._subscribers: list[trio.MemorySendChannel[MembershipEvent]] = []
        self._scope: trio.CancelScope | None = None
        self._done = trio.Event()
        self._stopped = False
        self._exit_stack: contextlib.AsyncExitStack | None = None
        self.log = log.bind(node=name, incarnation=incarnation)

    # -- what a backend implements ----------------------------------------------

    @abc.abstractmethod
    async def _run(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Set up, report ``started``, then keep the view current until cancelled."""

    @abc.abstractmethod
    async def _say_goodbye(self) -> None:
        """Tell the others we leave (called by ``stop()``, before cancelling)."""

    async def _close(self) -> None:  # noqa: B027 - optional hook
        """Release what ``_run`` opened; runs shielded after it ends."""

    @abc.abstractmethod
    def members(self) -> list[Member]:
        """Every member known (this node too), dead and left ones while
        remembered, sorted by name."""

    @abc.abstractmethod
    def member(self, name: str) -> Member | None:
        """One member, or None if unknown."""

    def statistics(self) -> dict[str, Any]:
        """The backend's own protocol counters, for ``status`` (none by default)."""
        return {}

    def suspect(self, name: str) -> None:  # noqa: B027 - optional hook
        """Local evidence that ``name`` died: a backend that can act on it
        (SWIM: start the suspicion now) does; etcd waits for the lease."""

    def detection_bound(self) -> float:
        """Seconds within which a member that died is declared dead (about):
        how long to wait for a verdict before trusting other evidence."""
        return 5.0

    def is_current(self, name: str, incarnation: int) -> bool:
        """True if ``incarnation`` is the running life of ``name``: check it
        before using a descriptor stamped with it. False for an earlier life,
        a dead or left member, or a name nobody knows."""
        m = self.member(name)
        return m is not None and m.incarnation == incarnation and m.running

    def check_current(self, name: str, incarnation: int) -> None:
        """``is_current``, raising ``StaleIncarnation`` (a ``PeerLost``) if not."""
        if not self.is_current(name, incarnation):
            m = self.member(name)
            now = "unknown" if m is None else f"{m.state} at incarnation {m.incarnation}"
            raise StaleIncarnation(f"{name} incarnation {incarnation} is not running ({name} "
                                   f"is {now})")

    @property
    def finished(self) -> bool:
        """True once the backend stopped running (stopped, or failed): its
        subscriptions have ended for good."""
        return self._done.is_set()

    # -- lifecycle --------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Start in ``nursery``; returns once running. Cancelled while starting:
        nothing is left behind."""
        if self._scope is not None:
            raise MembershipError("this backend was started already")
        self._scope = trio.CancelScope()
        await nursery.start(self._guarded)

    async def _guarded(self, *, task_status: trio.TaskStatus[None]) -> None:
        assert self._scope is not None
        try:
            with self._scope:
                await self._run(task_status=task_status)
        finally:
            with trio.CancelScope(shield=True):
                await self._close()
            for ch in self._subscribers:
                ch.close()
            self._subscribers.clear()
            self._done.set()

    async def stop(self, *, graceful: bool = True) -> None:
        """Leave: with ``graceful`` tell the others first (they see ``MemberLeft``);
        without, just vanish (they see ``MemberDead`` once they notice).
        Idempotent. Subscriptions end."""
        if self._scope is None or self._stopped:
            return
        self._stopped = True
        if graceful and not self._done.is_set():
            try:
                with trio.move_on_after(5):
                    await self._say_goodbye()
            except P2PXferError as exc:
                self.log.warning("membership.goodbye_failed", error=str(exc))
        self._scope.cancel()
        await self._done.wait()
        self.log.info("membership.stopped", graceful=graceful)

    async def __aenter__(self) -> Self:
        stack = contextlib.AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        try:
            await self.start(nursery)
        except BaseException:
            with trio.CancelScope(shield=True):
                await stack.aclose()
            raise
        self._exit_stack = stack
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._exit_stack is not None
        try:
            with trio.CancelScope(shield=exc_type is not None):
                await self.stop(graceful=exc_type is None)
        finally:
            await self._exit_stack.__aexit__(exc_type, exc, tb)

    # -- events -----------------------------------------------------------------

    def events(self) -> trio.MemoryReceiveChannel[MembershipEvent]:
        """A new subscription to membership events from now on (read
        ``members()`` for the state so far). A subscriber that falls
        ``SUBSCRIBER_BUFFER`` events behind is cut off: its channel ends and
        it must subscribe again and re-read ``members()``."""
        send, receive = trio.open_memory_channel[MembershipEvent](SUBSCRIBER_BUFFER)
        if self._done.is_set():
            send.close()
        else:
            self._subscribers.append(send)
        return receive

    def _publish(self, events: list[MembershipEvent]) -> None:
        for ev in events:
            self._log_event(ev)
            for ch in list(self._subscribers):
                try:
                    ch.send_nowait(ev)
                except trio.WouldBlock:
                    self.log.warning("membership.subscriber_dropped",
                                     buffered=SUBSCRIBER_BUFFER)
                    ch.close()
                    self._subscribers.remove(ch)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._subscribers.remove(ch)

    def _log_event(self, ev: MembershipEvent) -> None:
        if isinstance(ev, AuthFailed):
            self.log.warning("membership.auth_failed", source=ev.source, reason=ev.reason,
                             count=ev.count)
        elif isinstance(ev, BadDatagram):
            self.log.warning("membership.bad_datagram", source=ev.source, reason=ev.reason)
        elif isinstance(ev, Superseded):
            self.log.error("membership.superseded", newer_incarnation=ev.member.incarnation,
                           address=ev.member.address)
        else:
            m = ev.member
            extra: dict[str, object] = (
                {"previous_incarnation": ev.previous_incarnation}
                if isinstance(ev, MemberRestarted) else {})
            if m.addresses:
                extra["addresses"] = list(m.addresses)
            if isinstance(ev, MemberDegraded):
                extra["unreachable"] = list(m.unreachable)
            level = self.log.warning \
                if isinstance(ev, MemberDead | MemberSuspect | MemberDegraded) else self.log.info
            level(f"member.{ev.kind}", member=m.name, address=m.address,
                  member_incarnation=m.incarnation, **extra)
