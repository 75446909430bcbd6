"""The node daemon's composition root: ``Daemon`` wires its parts together,
``serve`` runs them.

The parts, one concern each: ``_peers`` (peer table and links),
``_regions`` (exports, resolved descriptors, ``locate``), ``_follow``
(membership, its watch log, ``PeerLost``), ``_writes`` (the write path),
``_auth``, ``_tls`` and ``_control`` (the control port), ``_sessions``
(clients on the unix socket), all over ``p2pxfer._pump``. ``Daemon`` holds them and answers
``status`` and ``peers``. What must not live here: protocol rules
(``p2pxfer.protocol``), the data path (``p2pxfer.engine``), or any one
part's state.
"""

from __future__ import annotations

import contextlib
import ipaddress
import resource
import signal
import time
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import trio

from p2pxfer._pump import LogThrottle
from p2pxfer.address import parse_hostport
from p2pxfer.engine import Engine, EngineConfig, open_engine
from p2pxfer.errors import ConfigError, EngineClosed
from p2pxfer.log import get_logger
from p2pxfer.membership import ClusterAuth

from ._admit import Admission
from ._config import DaemonConfig
from ._control import serve_control
from ._device import IpcMaps, takes_device_memory
from ._exports import Exports
from ._follow import Follower, rail_hosts
from ._imms import ImmTable
from ._kv import KV
from ._kv_push import Pushes
from ._limits import Limits
from ._listener import remove_socket, serve_clients
from ._metrics import DaemonMetrics, serve_metrics
from ._notes import rails, slow_paths
from ._peers import PeerTable
from ._ping import Ping
from ._ports import apply_fabric_ports, check_rail_ports
from ._regions import Regions
from ._tls import TlsCredentials, config_tls
from ._writes import Writes

if TYPE_CHECKING:
    from ._sessions import ClientSession

__all__ = ["Daemon", "check_exposure", "credentials", "raise_fd_limit", "serve"]

log = get_logger("p2pxfer.daemon")

STOP_MEMBERSHIP_S = 2.0  # at most this long saying goodbye on the way out
#: On the way out, tasks still running this long after stopping began (a write
#: waiting, shielded, for pieces posted to a peer that went silent) are cut
#: short: the engine is closed under them (see ``_close_engine_after``).
SHUTDOWN_GRACE_S = 2.0
FD_LIMIT_CAP = 1 << 20  # what we raise RLIMIT_NOFILE to when the hard limit is unlimited

OPEN_WARNING = ("no cluster_token and no TLS: the control port is OPEN: any process that "
                "reaches it can resolve regions and write into clients' memory (allowed "
                "only because every address is loopback)")
#: what ``status`` says of each credentials mode of the control port
SECURITY = {"token": "cluster token", "tls": "mutual TLS",
            "tls+token": "mutual TLS + cluster token"}


def credentials(config: DaemonConfig) -> str:
    """The control port's credentials: "open", "token", "tls" or "tls+token"."""
    modes = [m for m, on in (("tls", config.tls), ("token", bool(config.cluster_token))) if on]
    return "+".join(modes) or "open"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(config: DaemonConfig) -> bool:
    """Whether the daemon runs open (neither a cluster token nor TLS). Open
    is allowed only when every address it listens on is loopback: the control
    host, and the fabric's (``fabric_node``; empty means every interface),
    unless the provider is ``shm`` (no network). Otherwise ``ConfigError``
    (an ``InvalidArgument``) naming the flags and the keys that fix it."""
    if config.cluster_token or config.tls:
        return False
    exposed = []
    if not _loopback(parse_hostport(config.control)[0]):
        exposed.append(f"control {config.control} (--control)")
    if not config.provider.startswith("shm") and not _loopback(config.fabric_node):
        exposed.append(f"fabric_node {config.fabric_node or '(every interface)'} "
                       f"(--fabric-node)")
    if exposed:
        raise ConfigError(
            f"refusing to start without credentials on a non-loopback address "
            f"({', '.join(exposed)}): anyone who reaches it could write into clients' "
            "memory. Give every daemon the same secret with --token-file FILE (config: "
            "cluster_token_file or cluster_token), and/or mutual TLS with tls_ca, tls_cert "
            "and tls_key in the config (made by `p2pxfer certs`); or bind to 127.0.0.1 "
            "(--control 127.0.0.1:PORT --fabric-node 127.0.0.1). docs/deploy.md walks "
            "through two machines")
    return True


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (capped): a daemon holds
    one descriptor per client, peer link, control connection and memfd
    mapping. Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT_CAP if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT_CAP)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError) as exc:
            log.warning("daemon.fd_limit", error=str(exc), soft=soft, hard=hard)
    return soft


class Daemon:
    """One node daemon's parts; run it with :func:`serve` / ``nursery.start``."""

    def __init__(self, config: DaemonConfig, engine: Engine,
                 tls: TlsCredentials | None = None) -> None:
        self.config = config
        self.engine = engine
        self.node = config.node
        self.incarnation = engine.config.incarnation
        #: proves and checks the cluster token on control connections (None:
        #: no token configured, connections are not authenticated)
        self.auth = ClusterAuth(config.cluster_token.encode()) if config.cluster_token else None
        #: mutual TLS on control connections (None: not configured); ``serve``
        #: loads it before the engine opens, else it is loaded here
        self.tls = tls if tls is not None else config_tls(config)
        self.peers = PeerTable(self.node, config.peers, auth=self.auth,
                               max_frame=config.max_frame, max_peers=config.max_peers,
                               tls=self.tls)
        self._imm_slots: ImmTable | None = None
        #: clients' device allocations opened here (``share_device``)
        self.ipc_maps = IpcMaps(engine)
        #: every export of this daemon's clients (one record each)
        self.exports = Exports(self.node, engine, lambda: self.imm_slots)
        self.regions = Regions(self.node, self.peers, self.exports, lambda: self.imm_slots)
        self.peers.on_forget = self._forget_peer
        self.peers.on_reroute = self.regions.rerouted
        self.follower = Follower(self.node, self.peers)
        self.regions.reachable = self.follower.running
        self.follower.on_superseded = self._superseded
        self.writes = Writes(config, engine, self.regions, self.exports, self.follower,
                             incarnation=self.incarnation, imm_slots=lambda: self.imm_slots,
                             metrics=lambda: self.metrics)
        self.ping: Ping = Ping(self.node, engine, self.peers)
        self.kv: KV = KV(self.node, self.exports, lambda: self.imm_slots)
        self.kv.pushes = Pushes(self.kv, node=self.node, engine=engine, peers=self.peers,
                                regions=self.regions, writes=self.writes,
                                follower=self.follower, imm_slots=lambda: self.imm_slots,
                                write_timeout_s=config.write_timeout_s)
        self.follower.on_peer_lost = self.kv.peer_lost
        self.sessions: set[ClientSession] = set()
        #: caps per client and per uid, read from the sessions
        self.limits = Limits(config)
        #: (st_dev, st_ino) of our unix socket, so we remove only our own
        self.socket_identity: tuple[int, int] | None = None
        #: "open", "token", "tls" or "tls+token" (``status`` says it)
        self.credentials = credentials(config)
        self.open = self.credentials == "open"
        #: control connections: pending and authenticated, their caps
        self.admission = Admission(config)
        #: control connections being served, per source address
        self.control_connections: Counter[str] = self.admission.per_host
        #: connections refused for a cap: logged once a second at most
        self.refusals = LogThrottle()
        #: failed TLS handshakes: logged once a second at most
        self.tls_refusals = LogThrottle()
        self._nursery: trio.Nursery | None = None
        #: Prometheus metrics (None: ``metrics`` is not configured)
        self.metrics: DaemonMetrics | None = None
        #: slow paths found at startup (``status`` shows them)
        self.notes: list[str] = []

    @property
    def imm_slots(self) -> ImmTable:
        """Immediate slots: every arrival counts for its slot's owner only
        (made on first use: ``serve`` makes it before anything can arrive)."""
        if self._imm_slots is None:
            self._imm_slots = ImmTable(self.engine)
        return self._imm_slots

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

    def _forget_peer(self, peer: str) -> None:
        """``peer``'s life (or address) changed: what we resolved of it, and
        the notification tickets it holds here, go."""
        self.regions.forget_peer(peer)
        if self._imm_slots is not None:
            self._imm_slots.forget_peer(peer)

    def _superseded(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def serve_peers(self, nursery: trio.Nursery) -> None:
        """Listen on the control port (in ``nursery``)."""
        self.peers.control_address = await serve_control(self, nursery)

    def status(self, *, remote: bool = False) -> dict[str, Any]:
        """The ``status`` reply. ``remote`` (asked over the control port):
        no client pids; and while the port is open, no regions at all."""
        stats = self.engine.statistics()
        backend = self.follower.backend
        regions = self.regions.listing()
        if remote:
            regions = [] if self.open else [
                {k: v for k, v in r.items() if k != "client"} for r in regions]
        return {
            "node": self.node,
            "incarnation": self.incarnation,
            "control": self.control_address,
            "socket": self.config.socket,
            "provider": self.engine.config.provider,
            # clients' device memory is registered as is (share_device)
            "device_memory": takes_device_memory(self.engine),
            "clients": len(self.sessions),
            "regions": regions,
            "kv_pools": [] if remote else self.kv.listing(self.sessions),
            "security": f"open: {OPEN_WARNING}" if self.open else SECURITY[self.credentials],
            "credentials": self.credentials,
            "peers": self.peer_list(),
            "membership": self.config.membership,
            "membership_stats": {} if backend is None else backend.statistics(),
            "transfers_in_flight": self.writes.in_flight,
            "invalidations_pending": sum(self.regions.pending_invalidations.values()),
            "imm_bits": self.imm_slots.bits,
            "imm_value_bits": self.imm_slots.value_bits,
            "imms_dropped": self.imm_slots.dropped,
            "completed": stats.completed,
            "failed": stats.failed,
            "nics": [asdict(n) for n in stats.nics],  # with each NIC's rail pairs' state
            "failovers": stats.failovers,
            "pieces_reposted": stats.pieces_reposted,
            # small writes on a quiet engine: completed inline, or handed over
            "express": {"completed": stats.express, "handed_over": stats.express_handed_over},
            "local_copy": self.writes.local.statistics(),
            # notify writes whose notification's outcome was unknown: settled
            # (it had landed / it was counted on asking), or left unknown
            "notifications": dict(self.writes.notifications),
            "rails": rails(self.engine),
            "links": self.peers.link_states(),
            "notes": self.notes,
        }

    def peer_list(self) -> list[dict[str, Any]]:
        """The ``peers`` reply: static peers, or every member with its state
        when membership is on."""
        backend = self.follower.backend
        if backend is None:
            return self.peers.listing()
        now = trio.current_time()
        return [{"name": m.name, "address": m.address, "state": m.shown_state,
                 "incarnation": m.incarnation,
                 "last_heard_s": round(max(0.0, now - m.last_heard), 3),
                 "addresses": list(m.every_address), "unreachable": list(m.unreachable)}
                for m in backend.members()]


async def serve(config: DaemonConfig, *, handle_signals: bool = False,
                process_exits: bool = False,
                task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED) -> None:
    """Run a daemon until cancelled (or, with ``handle_signals``, until SIGINT
    or SIGTERM, then return normally). If a poller thread of its engine dies
    (a bug: nothing could be written any more) it stops the same way, then
    raises ``EngineClosed``: the CLI exits non-zero, to be restarted.
    ``nursery.start(serve, config)`` returns the :class:`Daemon` once both
    listeners are up.

    Stopping is bounded: it says goodbye to the cluster (at most
    ``STOP_MEMBERSHIP_S``), cancels every task, and whatever still runs
    ``SHUTDOWN_GRACE_S`` after stopping began (a write waiting for pieces
    posted to a silent peer) is failed by closing the engine under it.
    ``process_exits``: the process ends when this returns (the CLI), so the
    engine may leave to the kernel what libfabric cannot close safely
    (``Rail.close``).
    Refuses (``ConfigError``) to run open on a non-loopback address, and
    (``ConfigError``, naming the file) to start with TLS files that are not
    right."""
    is_open = check_exposure(config)
    apply_fabric_ports(config)
    tls = config_tls(config)  # a bad credentials file stops us before anything opens
    fd_limit = raise_fd_limit()
    engine_cfg = EngineConfig(
        provider=config.provider, node=config.fabric_node or None,
        interfaces=config.interfaces or None, node_name=config.node,
        incarnation=time.time_ns(), imm_bytes=config.imm_bytes,
        write_timeout_s=config.write_timeout_s, delivery_complete=config.delivery_complete,
        rail_stall_s=config.rail_stall_s, hmem=config.hmem,
    )
    sock = None
    # Shielded: the deadline holds also when serve() itself is cancelled.
    # Cancelled (done with) once every task of the daemon has ended.
    deadline = trio.CancelScope(shield=True)
    daemon: Daemon | None = None
    failure: BaseException | None = None
    try:
        async with open_engine(engine_cfg) as engine, trio.open_nursery() as guard:
            engine.process_exits = process_exits
            check_rail_ports(config, engine)
            try:
                async with trio.open_nursery() as nursery:
                    daemon = Daemon(config, engine, tls)
                    daemon.nursery = nursery
                    sock = await _start(daemon, nursery, fd_limit)
                    if is_open:  # said once it runs, so a failed start says one line
                        log.warning("daemon.open", node=config.node, warning=OPEN_WARNING)
                    try:
                        task_status.started(daemon)
                        failure = await _wait_for_stop(handle_signals, engine)
                    finally:
                        guard.start_soon(_close_engine_after, engine, deadline,
                                         SHUTDOWN_GRACE_S)
                        # Say goodbye (members see "left" at once), even when cancelled.
                        with trio.CancelScope(shield=True), \
                                trio.move_on_after(STOP_MEMBERSHIP_S):
                            await daemon.follower.stop()
                        nursery.cancel_scope.cancel()
            finally:
                deadline.cancel()
        if failure is not None:
            # Exit non-zero: the service manager starts a daemon that can write.
            raise EngineClosed(f"the daemon stopped: a poller thread of its engine failed "
                               f"({failure!r}); nothing could be written any more")
    finally:
        # Only now, with the accept loop gone, close and remove the socket.
        if sock is not None:
            sock.close()
        if daemon is not None:
            remove_socket(config.socket, daemon.socket_identity)


async def _start(daemon: Daemon, nursery: trio.Nursery,
                 fd_limit: int) -> trio.socket.SocketType:
    """Start the daemon's parts in ``nursery``; the client socket."""
    config, engine = daemon.config, daemon.engine
    daemon.notes = slow_paths(engine, config.provider)
    daemon.imm_slots  # noqa: B018  (the immediate route, before any export)
    await daemon.serve_peers(nursery)
    nursery.start_soon(daemon.peers.close_idle_links)
    nursery.start_soon(daemon.kv.reap)
    nursery.start_soon(daemon.exports.close_lingering)
    if config.metrics:
        daemon.metrics = DaemonMetrics(daemon)
        await nursery.start(serve_metrics, daemon.metrics, config.metrics)
    if config.membership != "none":
        # Membership on every rail the operator chose (``interfaces``), not on
        # whatever NICs discovery found (docker bridges share addresses).
        hosts = rail_hosts([r["address"] for r in rails(engine)]) if config.interfaces else []
        await daemon.follower.start(config, daemon.control_address, daemon.incarnation,
                                    nursery, hosts)
    sock = await serve_clients(daemon, nursery)
    log.info("daemon.ready", node=daemon.node, socket=config.socket,
             control=daemon.control_address, provider=config.provider,
             membership=config.membership, fd_limit=fd_limit,
             credentials=daemon.credentials)
    return sock


async def _wait_for_stop(handle_signals: bool, engine: Engine) -> BaseException | None:
    """Until SIGINT or SIGTERM (with ``handle_signals``; else until
    cancelled), or a poller thread of ``engine`` died: then its error. A
    daemon whose engine cannot write any more stops instead of answering
    every write with an error for ever. The signals are ours before this
    first yields: a SIGTERM right after start is a clean stop, not a kill."""
    failure: BaseException | None = None
    with (trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) if handle_signals
          else contextlib.nullcontext()) as received:
        async with trio.open_nursery() as nursery:
            async def signals() -> None:
                if received is None:
                    await trio.sleep_forever()
                    return
                async for signum in received:
                    log.info("daemon.stopping", signal=signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            async def poller() -> None:
                nonlocal failure
                failure = await engine.poller_failure()
                log.error("daemon.stopping", reason="engine_failed", error=repr(failure))
                nursery.cancel_scope.cancel()

            nursery.start_soon(signals)
            nursery.start_soon(poller)
    return failure


async def _close_engine_after(engine: Engine, deadline: trio.CancelScope,
                              grace_s: float) -> None:
    """Stopping began: if tasks still run after ``grace_s`` (``deadline`` not
    cancelled by then), close the engine under them. That fails every write in
    flight with ``EngineClosed`` (a cancelled write waiting, shielded, for the
    pieces it posted wakes up) and closes the rails, so nothing posted can land
    later. Only daemon shutdown cuts a write's wait short this way."""
    with deadline:
        await trio.sleep(grace_s)
        stats = engine.statistics()
        log.warning("daemon.shutdown_forced", grace_s=grace_s,
                    in_flight=sum(stats.in_flight))
        await engine.aclose()
