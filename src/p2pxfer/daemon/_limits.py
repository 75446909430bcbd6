"""Caps on what one client, and one uid, may make the daemon hold.

Per client (every uid): requests in flight (those served as tasks: writes,
waits, pushes...), bytes of shared memory mapped, exports (each holds an
immediate slot). Per uid (any uid but root and the daemon's own, which run
the node's services): sessions, and the sums of the client caps over its
sessions, mapped bytes counting the ranges still held after its memory was
released (``_retire``: the address space is what runs out). Root and the
daemon's uid also get ``PRIVILEGED_RESERVE`` sessions beyond
``max_clients``, so a full socket never locks them out. Every refusal is a
``LimitExceeded`` (wire code ``limit``) naming the cap, logged
``limit.refused`` at most once a second.

Usage is read from the sessions themselves, never counted apart, so what a
client held comes back the moment its session lets go of it. What must not
live here: serving requests (``_sessions``), mapping memory (``_shared``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import trio

from p2pxfer._pump import LogThrottle
from p2pxfer.errors import LimitExceeded
from p2pxfer.log import get_logger

from ._config import DaemonConfig
from ._retire import held_bytes

if TYPE_CHECKING:
    from ._sessions import ClientSession

__all__ = ["PRIVILEGED_RESERVE", "Limits", "privileged"]

log = get_logger("p2pxfer.daemon")

#: sessions root and the daemon's uid may open beyond ``max_clients``
PRIVILEGED_RESERVE = 16


_OWN_UID = os.getuid()


def privileged(uid: int) -> bool:
    """Root or the daemon's own uid: runs the node's services."""
    return uid in (0, _OWN_UID)


class Limits:
    """The caps of one daemon, checked against its sessions."""

    def __init__(self, config: DaemonConfig) -> None:
        self.c = config
        self.by_uid: dict[int, set[ClientSession]] = {}
        self._throttle = LogThrottle()

    # -- sessions ---------------------------------------------------------------------

    def admit(self, uid: int, sessions: int) -> str | None:
        """Why a new session of ``uid`` is refused (``sessions`` are open
        now), or None."""
        c = self.c
        if privileged(uid):
            if sessions >= c.max_clients + PRIVILEGED_RESERVE:
                return (f"{sessions} clients already connected (max_clients {c.max_clients}"
                        f" + {PRIVILEGED_RESERVE} kept for root and the daemon's uid)")
            return None
        if sessions >= c.max_clients:
            return f"{sessions} clients already connected (max_clients {c.max_clients})"
        mine = len(self.by_uid.get(uid, ()))
        if mine >= c.max_clients_per_uid:
            return (f"uid {uid} has {mine} clients connected already "
                    f"(max_clients_per_uid {c.max_clients_per_uid})")
        return None

    def joined(self, s: ClientSession) -> None:
        self.by_uid.setdefault(s.uid, set()).add(s)

    def left(self, s: ClientSession) -> None:
        mine = self.by_uid.get(s.uid)
        if mine is not None:
            mine.discard(s)
            if not mine:
                del self.by_uid[s.uid]

    def _uid_sessions(self, s: ClientSession) -> Iterable[ClientSession]:
        return self.by_uid.get(s.uid, ()) if not privileged(s.uid) else ()

    def refuse(self, s: ClientSession | None, what: str, message: str,
               uid: int | None = None) -> LimitExceeded:
        skipped = self._throttle.due(trio.current_time())
        if skipped is not None:
            log.warning("limit.refused", client=None if s is None else s.label,
                        uid=uid if s is None else s.uid, limit=what, not_logged=skipped,
                        reason=message)
        return LimitExceeded(message)

    # -- what a session holds -----------------------------------------------------------

    def request(self, s: ClientSession, kind: str) -> None:
        """Before a request runs as a task. A ``cancel`` has room of its own
        (as many again): a client at its cap can still stop what it started."""
        c = self.c
        cap = c.max_requests_per_client * (2 if kind == "cancel" else 1)
        if len(s.running) >= cap:
            raise self.refuse(s, "max_requests_per_client",
                              f"{len(s.running)} requests of this client are in flight "
                              f"(max_requests_per_client {c.max_requests_per_client})")
        mine = sum(len(o.running) for o in self._uid_sessions(s))
        if mine >= c.max_requests_per_uid * (2 if kind == "cancel" else 1):
            raise self.refuse(s, "max_requests_per_uid",
                              f"{mine} requests of uid {s.uid} are in flight "
                              f"(max_requests_per_uid {c.max_requests_per_uid})")

    def share(self, s: ClientSession, size: int, doing: str = "sharing") -> None:
        """Before ``size`` more bytes of ``s``'s memory are mapped (shared,
        or an export's own mapping of its range)."""
        c = self.c
        mapped = s.mapped
        if mapped + size > c.max_mapped_per_client:
            raise self.refuse(s, "max_mapped_per_client",
                              f"{doing} {size} bytes more would map {mapped + size} bytes of "
                              f"this client (max_mapped_per_client {c.max_mapped_per_client})")
        if privileged(s.uid):
            return
        mine = sum(o.mapped for o in self._uid_sessions(s)) + held_bytes(s.uid)
        if mine + size > c.max_mapped_per_uid:
            raise self.refuse(s, "max_mapped_per_uid",
                              f"{doing} {size} bytes more would map {mine + size} bytes of "
                              f"uid {s.uid}, counting ranges still held after release "
                              f"(max_mapped_per_uid {c.max_mapped_per_uid})")

    def export(self, s: ClientSession, length: int) -> None:
        """Before ``s`` exports one more region (each holds an immediate slot,
        and maps its ``length`` bytes once more)."""
        c = self.c
        self.share(s, length, "exporting")
        if len(s.exports) >= c.max_exports_per_client:
            raise self.refuse(s, "max_exports_per_client",
                              f"this client has {len(s.exports)} exports "
                              f"(max_exports_per_client {c.max_exports_per_client})")
        mine = sum(len(o.exports) for o in self._uid_sessions(s))
        if mine >= c.max_exports_per_uid:
            raise self.refuse(s, "max_exports_per_uid",
                              f"uid {s.uid} has {mine} exports "
                              f"(max_exports_per_uid {c.max_exports_per_uid})")

    def idle_s(self, s: ClientSession) -> float | None:
        """How long ``s`` may stay silent before it is closed: only a session
        of an unprivileged uid that holds nothing (no memory, no request in
        flight) is closed for idling; None: no limit now."""
        if privileged(s.uid) or not self.c.client_idle_s or s.mems or s.running:
            return None
        return self.c.client_idle_s
