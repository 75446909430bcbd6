"""Prometheus metrics of a running daemon, served as text on ``metrics``
(host:port) through ``prometheus-client``.

Everything is read at scrape time from the daemon's public snapshots
(``engine.statistics()``, the registration caches' ``statistics()``,
``peer_list()``, the membership backend's counters) by one custom collector,
so the data path carries no metric hooks. The one exception is the write
latency histogram: a latency exists only at the moment a write ends, so the
daemon's write handler calls :meth:`DaemonMetrics.observe_write` once per write.

The HTTP side is a small trio server, so a scrape runs in the daemon's own
thread and sees a consistent state (no locks, nothing read mid-update).
What must not live here: anything that changes the daemon's state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from p2pxfer._pump import LogThrottle
from p2pxfer.errors import StartupError
from p2pxfer.log import get_logger

from ._config import parse_hostport

if TYPE_CHECKING:
    from p2pxfer.engine import EngineStats

    from ._daemon import Daemon

__all__ = ["DaemonMetrics", "serve_metrics"]

log = get_logger("p2pxfer.metrics")

MEMBER_STATES = ("alive", "suspect", "dead", "left")
REQUEST_LIMIT = 8192  # bytes of request head a scraper may send
REQUEST_TIMEOUT_S = 5.0
MAX_SCRAPES = 8  # connections served at once; more wait for their turn
#: connections held at once (served or waiting their turn); more are closed
#: at once, so a flood of silent connections cannot take every descriptor
MAX_CONNECTIONS = 32
ACCEPT_BACKOFF_S = 0.1  # after accept failed (descriptors or memory ran out)
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
#: write latency buckets, seconds: 50 us (a small write on shm) to 10 s
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class DaemonMetrics(Collector):
    """The registry of one daemon: the scrape-time collector plus the write
    latency histogram."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.write_seconds = Histogram(
            "p2pxfer_write_seconds", "Client writes, from request to landed, by outcome",
            ["outcome"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe_write(self, seconds: float, ok: bool) -> None:
        self.write_seconds.labels("ok" if ok else "failed").observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        d = self.daemon
        stats = d.engine.statistics()
        rail = ["shard", "nic", "provider"]
        fam: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "bytes": CounterMetricFamily("p2pxfer_rail_bytes", "Bytes posted per rail",
                                         labels=rail),
            "pieces": CounterMetricFamily("p2pxfer_rail_pieces", "WRITEs posted per rail",
                                          labels=rail),
            "completed": CounterMetricFamily("p2pxfer_rail_completed_pieces",
                                             "WRITEs completed per rail", labels=rail),
            "errors": CounterMetricFamily("p2pxfer_rail_errors",
                                          "Error completions per rail", labels=rail),
            "received": CounterMetricFamily("p2pxfer_rail_received_pieces",
                                            "Remote writes that landed here, per rail",
                                            labels=rail),
            "inflight": GaugeMetricFamily("p2pxfer_rail_inflight",
                                          "WRITEs posted and not yet completed, per rail",
                                          labels=rail),
        }
        for nic in stats.nics:
            labels = [str(nic.shard), nic.name, nic.provider]
            for key, family in fam.items():
                family.add_metric(labels, getattr(nic, key))
        yield from fam.values()
        pools = GaugeMetricFamily("p2pxfer_kv_pool_bytes", "Bytes of clients' KV pools, by the "
                                  "memory they keep them in (host, cuda) and the path it "
                                  "takes (host; staged through host memory; direct)",
                                  labels=["kind", "path"])
        by_kind = Counter[tuple[str, str]]()
        for p in d.kv.listing(d.sessions):
            by_kind[p["kind"], p["path"]] += p["nbytes"]
        for kind, path in (("host", "host"), ("cuda", "staged"), ("cuda", "direct")):
            pools.add_metric([kind, path], by_kind[kind, path])
        yield pools
        yield from self._pairs(stats)
        transfers = CounterMetricFamily("p2pxfer_transfers", "Engine transfers that ended",
                                        labels=["outcome"])
        transfers.add_metric(["completed"], stats.completed)
        transfers.add_metric(["failed"], stats.failed)
        transfers.add_metric(["cancelled"], stats.cancelled)
        yield transfers
        yield _gauge("p2pxfer_writes_in_flight", "Client writes running", d.writes.in_flight)
        yield _gauge("p2pxfer_client_sessions", "Clients connected", len(d.sessions))
        yield _gauge("p2pxfer_regions_exported", "Regions exported by clients",
                     len(d.regions.listing()))
        yield from self._cache(d)
        yield from self._members(d)

    def _pairs(self, stats: EngineStats) -> Iterator[Metric]:
        """Rail pairs (our NIC, a peer's NIC): up or not, and failovers."""
        labels = ["shard", "nic", "peer"]
        up = GaugeMetricFamily("p2pxfer_rail_pair_up", "1 if the rail pair is up, 0 if "
                               "down or probing", labels=labels)
        downs = CounterMetricFamily("p2pxfer_rail_pair_downs", "Times the rail pair went "
                                    "down", labels=labels)
        for nic in stats.nics:
            for p in nic.pairs:
                up.add_metric([str(nic.shard), nic.name, p.peer], int(p.state == "up"))
                downs.add_metric([str(nic.shard), nic.name, p.peer], p.downs)
        yield up
        yield downs
        yield CounterMetricFamily("p2pxfer_rail_failovers", "Rail pairs taken down, their "
                                  "writes moved to other pairs", value=stats.failovers)
        yield CounterMetricFamily("p2pxfer_rail_pieces_reposted", "Pieces posted again on "
                                  "another rail pair", value=stats.pieces_reposted)
        express = CounterMetricFamily("p2pxfer_express_writes", "Small writes on a quiet "
                                      "engine posted and polled for inline: completed so, "
                                      "or handed over as regular transfers",
                                      labels=["outcome"])
        express.add_metric(["completed"], stats.express)
        express.add_metric(["handed_over"], stats.express_handed_over)
        yield express

    def _cache(self, d: Daemon) -> Iterator[Metric]:
        names = {"hits": "lookups that found a registration",
                 "misses": "lookups that had to register",
                 "evictions": "registrations dropped to make room"}
        counters = {k: CounterMetricFamily(f"p2pxfer_registration_cache_{k}",
                                           f"Registration cache {text}", labels=["shard"])
                    for k, text in names.items()}
        entries = GaugeMetricFamily("p2pxfer_registration_cache_entries",
                                    "Registrations held", labels=["shard"])
        for shard in d.engine.shards:
            cs = shard.memory.registrations()
            for key, family in counters.items():
                family.add_metric([str(shard.index)], getattr(cs, key))
            entries.add_metric([str(shard.index)], cs.entries)
        yield from counters.values()
        yield entries

    def _members(self, d: Daemon) -> Iterator[Metric]:
        if d.follower.backend is not None:
            states = Counter(str(p["state"]) for p in d.peer_list())
        else:  # static peers: the state of our control connection to each
            links = {link["name"]: link["state"] for link in d.status()["links"]}
            states = Counter(links.get(name, "not contacted") for name in d.peers.peers)
        members = GaugeMetricFamily("p2pxfer_peers", "Peers (members) by state",
                                    labels=["state"])
        for state in sorted({*MEMBER_STATES, *states}) if d.follower.backend else sorted(states):
            members.add_metric([state], states.get(state, 0))
        yield members
        if d.follower.backend is not None:
            proto = GaugeMetricFamily("p2pxfer_membership_counter",
                                      "The membership backend's own counters",
                                      labels=["backend", "name"])
            for name, value in sorted(d.follower.backend.statistics().items()):
                if isinstance(value, int | float) and not isinstance(value, bool):
                    proto.add_metric([d.config.membership, name], value)
            yield proto


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


async def serve_metrics(metrics: DaemonMetrics, address: str, *,
                        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``GET /metrics`` on ``address`` until cancelled; ``nursery.start``
    returns the bound host:port. A port that cannot be bound is a
    :class:`StartupError` naming it."""
    host, port = parse_hostport(address)
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise StartupError("cannot serve metrics on", address, exc.strerror or str(exc)) from exc
    bound = listeners[0].socket.getsockname()
    where = f"{bound[0]}:{bound[1]}"
    log.info("metrics.ready", address=where)
    task_status.started(where)  # bound already: scrapes queue until served
    limiter = trio.CapacityLimiter(MAX_SCRAPES)
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept, metrics, limiter, listener)


async def _accept(metrics: DaemonMetrics, limiter: trio.CapacityLimiter,
                  listener: trio.SocketListener) -> None:
    """Our own accept loop (not ``trio.serve_listeners``): connections past
    ``MAX_CONNECTIONS`` are closed at once, and a failed accept is logged
    once a second at most, not with a traceback each time."""
    held = [0]
    refused, failed = LogThrottle(), LogThrottle()
    async with trio.open_nursery() as nursery:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if (skipped := failed.due(trio.current_time())) is not None:
                    log.error("metrics.accept_failed", error=str(exc), not_logged=skipped)
                await trio.sleep(ACCEPT_BACKOFF_S)
                continue
            if held[0] >= MAX_CONNECTIONS:
                if (skipped := refused.due(trio.current_time())) is not None:
                    log.warning("limit.refused", limit="metrics connections",
                                reason=f"{MAX_CONNECTIONS} metrics connections open",
                                not_logged=skipped)
                with trio.CancelScope(shield=True):
                    await stream.aclose()
                continue
            held[0] += 1
            nursery.start_soon(_held, metrics, limiter, stream, held)


async def _held(metrics: DaemonMetrics, limiter: trio.CapacityLimiter,
                stream: trio.SocketStream, held: list[int]) -> None:
    try:
        await _answer(metrics, limiter, stream)
    finally:
        held[0] -= 1


async def _answer(metrics: DaemonMetrics, limiter: trio.CapacityLimiter,
                  stream: trio.SocketStream) -> None:
    """One scrape. Whatever the scraper does (resets, garbage, silence) ends
    this connection only, never the daemon."""
    async with limiter, stream:
        try:
            head = await _read_head(stream)
            await stream.send_all(_response(metrics, head))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the scraper left; its loss


async def _read_head(stream: trio.SocketStream) -> bytes:
    head = b""
    with trio.move_on_after(REQUEST_TIMEOUT_S):
        while b"\r\n\r\n" not in head and len(head) < REQUEST_LIMIT:
            data = await stream.receive_some(4096)
            if not data:
                break
            head += data
    return head


def _response(metrics: DaemonMetrics, head: bytes) -> bytes:
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or parts[0] != b"GET":
        status, body, ctype = b"400 Bad Request", b"GET /metrics\n", b"text/plain"
    elif parts[1].split(b"?")[0] not in (b"/metrics", b"/"):
        status, body, ctype = b"404 Not Found", b"GET /metrics\n", b"text/plain"
    else:
        try:
            status, body, ctype = b"200 OK", metrics.render(), CONTENT_TYPE
        except Exception as exc:  # a collector bug must not take the daemon down
            log.error("metrics.failed", error=repr(exc))
            status, body, ctype = b"500 Internal Server Error", b"see the daemon's log\n", \
                b"text/plain"
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: " +
            str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
