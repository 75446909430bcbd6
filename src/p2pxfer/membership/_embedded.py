"""The embedded backend: ``Swim`` over UDP, on trio. No extra service.

One datagram socket per address of the member: its membership address (a
loopback or namespace address in tests), and one per further rail
(``rails``), all advertised, so the member is probed on every rail. One task
per socket receives and answers; one runs the protocol's timers at
``Swim.next_deadline()``; a short one per host check (a TCP connection to a
suspect's address, ``SwimConfig.host_check``) reports its answer. All run
in the trio thread, which owns the ``Swim`` state.
What must not live here: protocol rules (``_swim*.py``).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import trio

from ._backend import MembershipBackend, MembershipError
from ._hostcheck import check_host, join_hostport, split_hostport
from ._member import Member, new_incarnation
from ._swim import Outgoing, Swim, SwimConfig

__all__ = ["EmbeddedBackend"]

_MAX_DATAGRAM = 65536


class EmbeddedBackend(MembershipBackend):
    """SWIM over UDP.

    ``bind`` is ``host:port`` (port 0: any free one); the member's address
    is what was bound, or ``advertise`` (needed when binding a wildcard).
    ``seeds`` are other members' addresses; ``start()`` waits up to
    ``join_timeout`` seconds for one of them to admit us and otherwise goes
    on alone, retrying (see ``joined``). ``leave_linger``: after a graceful
    leave, keep answering this long (default one protocol period) so pings in
    flight hear the news. ``rails``: more local IP addresses (one per further
    rail) to bind the same port on and advertise; one that cannot be bound is
    left out (logged).
    """

    def __init__(self, name: str, bind: str, token: bytes, seeds: Sequence[str] = (), *,
                 incarnation: int | None = None, advertise: str | None = None,
                 config: SwimConfig | None = None, join_timeout: float = 5.0,
                 leave_linger: float | None = None, rails: Sequence[str] = ()) -> None:
        super().__init__(name, new_incarnation() if incarnation is None else incarnation)
        self.config = config or SwimConfig()
        self._bind = split_hostport(bind)
        self._advertise = advertise
        self._token = token
        self._seeds = tuple(seeds)
        self._join_timeout = join_timeout
        self._linger = self.config.period if leave_linger is None else leave_linger
        self._rails = tuple(rails)
        self._sock: trio.socket.SocketType | None = None
        self._socks: list[trio.socket.SocketType] = []  # [0] is _sock
        self._swim: Swim | None = None
        self._wake = trio.Event()  # the receive side moved the next deadline earlier
        self._nursery: trio.Nursery | None = None
        self._sleeping_until = 0.0
        self._joined = trio.Event()
        self.address = ""

    # -- views --------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        """SWIM's counters: datagrams, bytes, probes, suspicions, auth failures..."""
        return asdict(self._swim.statistics()) if self._swim is not None else {}

    def suspect(self, name: str) -> None:
        swim = self._swim
        if swim is None or not swim.suspect(name, trio.current_time()):
            return
        self._publish(swim.take_events())
        if swim.next_deadline() < self._sleeping_until:
            self._wake.set()  # the suspicion's deadline is sooner than our nap

    def detection_bound(self) -> float:
        # Probed within a period or two (round robin over the members, several
        # probers), suspected for the suspicion timeout, and gossip to spread
        # the verdict: with a period of slack for a loaded machine.
        if self._swim is None:
            return 5.0
        # A silent host (no answer to the host check) takes one check more.
        return 4 * self.config.period + self._swim.suspicion_timeout() + self.config.host_check

    @property
    def swim(self) -> Swim:
        if self._swim is None:
            raise MembershipError("the backend is not started")
        return self._swim

    @property
    def joined(self) -> bool:
        return self._swim is not None and self._swim.joined

    def members(self) -> list[Member]:
        return [] if self._swim is None else self._swim.members()

    def member(self, name: str) -> Member | None:
        return None if self._swim is None else self._swim.member(name)

    def is_current(self, name: str, incarnation: int) -> bool:
        return self._swim is not None and self._swim.is_current(name, incarnation)

    async def wait_joined(self) -> None:
        """Wait until a seed admitted us (at once without seeds)."""
        await self._joined.wait()

    # -- running ------------------------------------------------------------------

    async def _run(self, *, task_status: trio.TaskStatus[None]) -> None:
        host, port = self._bind
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = self._sock = trio.socket.socket(family, socket.SOCK_DGRAM)
        try:
            await sock.bind((host, port))
        except OSError as exc:
            raise MembershipError(f"cannot bind the membership socket to "
                                  f"{join_hostport(host, port)}: {exc}") from exc
        bound = sock.getsockname()
        if self._advertise:
            self.address = self._advertise
        elif host in ("0.0.0.0", "::", ""):
            raise MembershipError("binding a wildcard address needs advertise=host:port")
        else:
            self.address = join_hostport(bound[0], bound[1])
        self._socks = [sock]
        addresses = [self.address] + await self._bind_rails(bound[1])
        swim = self._swim = Swim(Member(self.name, self.address, self.incarnation,
                                        addresses=tuple(addresses)),
                                 self._token, self.config)
        self.log = self.log.bind(address=self.address)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for via, s in enumerate(self._socks):
                nursery.start_soon(self._receive_loop, s, via)
            await self._send(swim.join(list(self._seeds), trio.current_time()))
            nursery.start_soon(self._timer_loop)
            if swim.joined:
                self._joined.set()
            else:
                with trio.move_on_after(self._join_timeout):
                    await self._joined.wait()
                if not swim.joined:
                    self.log.warning("membership.join_pending", seeds=list(self._seeds),
                                     waited_s=self._join_timeout)
            self.log.info("membership.started", seeds=list(self._seeds), joined=swim.joined)
            task_status.started()

    async def _bind_rails(self, port: int) -> list[str]:
        """Bind a socket on each rail address (same port); their addresses."""
        out: list[str] = []
        for host in self._rails:
            if host == self._bind[0] or join_hostport(host, port) in out:
                continue
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            s = trio.socket.socket(family, socket.SOCK_DGRAM)
            try:
                await s.bind((host, port))
            except OSError as exc:
                s.close()
                self.log.warning("membership.rail_unbound", rail=host, port=port,
                                 error=str(exc))
                continue
            self._socks.append(s)
            out.append(join_hostport(host, port))
        return out

    async def _receive_loop(self, sock: trio.socket.SocketType, via: int) -> None:
        assert self._swim is not None
        swim = self._swim
        while True:
            try:
                data, addr = await sock.recvfrom(_MAX_DATAGRAM)
            except OSError as exc:  # e.g. an ICMP error queued on the socket
                self.log.debug("membership.receive_failed", error=str(exc))
                await trio.sleep(0.01)  # never a hot loop, whatever the error
                continue
            out = swim.receive(data, join_hostport(addr[0], addr[1]), trio.current_time(), via)
            await self._send(out)
            if swim.joined and not self._joined.is_set():
                self._joined.set()
            if swim.next_deadline() < self._sleeping_until:
                self._wake.set()

    async def _timer_loop(self) -> None:
        swim = self.swim
        while True:
            self._sleeping_until = swim.next_deadline()
            with trio.move_on_at(self._sleeping_until):
                await self._wake.wait()
            if self._wake.is_set():
                self._wake = trio.Event()
            await self._send(swim.tick(trio.current_time()))

    async def _send(self, out: list[Outgoing]) -> None:
        assert self._swim is not None and self._socks
        for o in out:
            sock = self._socks[o.via] if o.via < len(self._socks) else self._socks[0]
            try:
                await sock.sendto(o.data, split_hostport(o.address))
            except (OSError, MembershipError) as exc:
                self.log.debug("membership.send_failed", to=o.address, kind=o.kind,
                               error=str(exc))
        self._publish(self._swim.take_events())
        if self._nursery is not None:
            for name, incarnation, address in self._swim.take_host_checks():
                self._nursery.start_soon(self._check_host, name, incarnation, address)

    async def _check_host(self, name: str, incarnation: int, address: str) -> None:
        """A suspect's suspicion ran out (``SwimConfig.host_check``): ask its
        host (``check_host``). Accepted keeps a starved member suspect; a
        refusal makes it dead now; no answer, at the end of the check."""
        swim = self.swim
        verdict, why = await check_host(address, self.config.host_check * 0.8)
        if verdict == "answered":
            swim.host_answered(name, incarnation)
        elif verdict == "refused":
            swim.host_refused(name, incarnation, trio.current_time())
            if swim.next_deadline() < self._sleeping_until:
                self._wake.set()
        self.log.info("membership.host_checked", member=name, verdict=verdict, why=why)

    async def _say_goodbye(self) -> None:
        if self._swim is None or self._sock is None:
            return
        await self._send(self._swim.leave(trio.current_time()))
        await trio.sleep(self._linger)

    async def _close(self) -> None:
        for s in self._socks:
            s.close()
        if self._sock is not None:
            self._sock.close()
