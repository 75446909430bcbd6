"""The node daemon's composition root: ``Daemon`` wires its parts together,
``serve`` runs them.

The parts, one concern each: ``_peers`` (peer table and links),
``_regions`` (exports, resolved descriptors, ``locate``), ``_follow``
(membership, its watch log, ``PeerLost``), ``_writes`` (the write path),
``_auth`` and ``_control`` (the control port), ``_sessions`` (clients on the
unix socket), all over ``p2pxfer._pump``. ``Daemon`` holds them and answers
``status`` and ``peers``. What must not live here: protocol rules
(``p2pxfer.protocol``), the data path (``p2pxfer.engine``), or any one
part's state.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import structlog
import trio

from p2pxfer.engine import Engine, EngineConfig, open_engine
from p2pxfer.membership import ClusterAuth

from ._config import DaemonConfig
from ._control import serve_control
from ._follow import Follower
from ._imms import ImmTable
from ._kv import KV
from ._peers import PeerTable
from ._regions import Regions
from ._sessions import serve_clients
from ._writes import Writes

if TYPE_CHECKING:
    from ._sessions import ClientSession

__all__ = ["Daemon", "serve"]

log = structlog.get_logger("p2pxfer.daemon")

STOP_MEMBERSHIP_S = 3.0  # at most this long saying goodbye on the way out


class Daemon:
    """One node daemon's parts; run it with :func:`serve` / ``nursery.start``."""

    def __init__(self, config: DaemonConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.node = config.node
        self.incarnation = engine.config.incarnation
        #: proves and checks the cluster token on control connections (None:
        #: no token configured, connections are not authenticated)
        self.auth = ClusterAuth(config.cluster_token.encode()) if config.cluster_token else None
        self.peers = PeerTable(self.node, config.peers, auth=self.auth,
                               max_frame=config.max_frame)
        self.regions = Regions(self.node, self.peers)
        self.follower = Follower(self.node, self.peers)
        self.regions.reachable = self.follower.running
        self.follower.on_superseded = self._superseded
        self.writes = Writes(self)
        self._imms: ImmTable | None = None
        self.kv: KV = KV(self)
        self.follower.on_peer_lost = self.kv.peer_lost
        self.sessions: set[ClientSession] = set()
        self._nursery: trio.Nursery | None = None

    @property
    def imms(self) -> ImmTable:
        """Immediate slots: every arrival counts for its slot's owner only
        (made on first use: ``serve`` makes it before anything can arrive)."""
        if self._imms is None:
            self._imms = ImmTable(self.engine)
        return self._imms

    @property
    def control_address(self) -> str:
        """Our control listener's ``host:port`` (once listening)."""
        return self.peers.control_address

    @property
    def nursery(self) -> trio.Nursery | None:
        return self._nursery

    @nursery.setter
    def nursery(self, nursery: trio.Nursery | None) -> None:
        """Where background work (closing links, invalidations) runs."""
        self._nursery = self.peers.nursery = self.regions.nursery = nursery

    def _superseded(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def serve_peers(self, nursery: trio.Nursery) -> None:
        """Listen on the control port (in ``nursery``)."""
        self.peers.control_address = await serve_control(self, nursery)

    def status(self) -> dict[str, Any]:
        stats = self.engine.statistics()
        backend = self.follower.backend
        return {
            "node": self.node,
            "incarnation": self.incarnation,
            "control": self.control_address,
            "socket": self.config.socket,
            "provider": self.engine.config.provider,
            "clients": len(self.sessions),
            "regions": self.regions.listing(),
            "peers": self.peer_list(),
            "membership": self.config.membership,
            "membership_stats": {} if backend is None else backend.statistics(),
            "transfers_in_flight": self.writes.in_flight,
            "imm_bits": self.imms.bits,
            "imms_dropped": self.imms.dropped,
            "completed": stats.completed,
            "failed": stats.failed,
            "nics": [asdict(n) for n in stats.nics],
        }

    def peer_list(self) -> list[dict[str, Any]]:
        """The ``peers`` reply: static peers, or every member with its state
        when membership is on."""
        backend = self.follower.backend
        if backend is None:
            return self.peers.listing()
        now = trio.current_time()
        return [{"name": m.name, "address": m.address, "state": str(m.state),
                 "incarnation": m.incarnation,
                 "last_heard_s": round(max(0.0, now - m.last_heard), 3)}
                for m in backend.members()]


async def serve(config: DaemonConfig, *, handle_signals: bool = False,
                task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED) -> None:
    """Run a daemon until cancelled (or, with ``handle_signals``, until SIGINT
    or SIGTERM, then return normally). ``nursery.start(serve, config)``
    returns the :class:`Daemon` once both listeners are up."""
    engine_cfg = EngineConfig(
        provider=config.provider, node=config.fabric_node or None,
        interfaces=config.interfaces or None, node_name=config.node,
        incarnation=time.time_ns(), imm_bytes=config.imm_bytes,
    )
    sock = None
    try:
        async with open_engine(engine_cfg) as engine, trio.open_nursery() as nursery:
            daemon = Daemon(config, engine)
            daemon.imms  # noqa: B018  (the immediate route, before any export)
            daemon.nursery = nursery
            await daemon.serve_peers(nursery)
            nursery.start_soon(daemon.peers.close_idle_links)
            nursery.start_soon(daemon.kv.reap)
            if config.membership != "none":
                await daemon.follower.start(config, daemon.control_address,
                                            daemon.incarnation, nursery)
            sock = await serve_clients(daemon, nursery)
            log.info("daemon.ready", node=daemon.node, socket=config.socket,
                     control=daemon.control_address, provider=config.provider,
                     membership=config.membership)
            try:
                task_status.started(daemon)
                if handle_signals:
                    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                        async for signum in signals:
                            log.info("daemon.stopping", signal=signal.Signals(signum).name)
                            break
                else:
                    await trio.sleep_forever()
            finally:
                # Say goodbye (members see "left" at once), even when cancelled.
                with trio.CancelScope(shield=True), trio.move_on_after(STOP_MEMBERSHIP_S):
                    await daemon.follower.stop()
                nursery.cancel_scope.cancel()
    finally:
        # Only now, with the accept loop gone, close and remove the socket.
        if sock is not None:
            sock.close()
        with contextlib.suppress(OSError):
            os.unlink(config.socket)
