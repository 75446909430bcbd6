"""The daemon's configuration: a TOML file, every key documented here and in
``deploy/p2pxfer.toml``. Unknown keys are errors (a typo must not be ignored),
and every key's type and range is checked here, before anything opens, so a
wrong config is one :class:`ConfigError` naming the key, the file and what the
key must be. What must not live here: opening sockets, files other than the
config and the token file (the TLS files are read where they are used,
``_tls``), or anything that needs the network."""

from __future__ import annotations

import socket
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from p2pxfer.address import parse_hostport
from p2pxfer.errors import ConfigError, InvalidArgument
from p2pxfer.protocol._messages import MAX_NAME

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "MEMBERSHIP_BACKENDS", "TLS_KEYS", "DaemonConfig",
           "PeerAddress", "parse_hostport", "parse_peer"]

MEMBERSHIP_BACKENDS = ("none", "embedded", "etcd")
TLS_KEYS = ("tls_ca", "tls_cert", "tls_key")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("console", "json")


def parse_peer(text: str) -> PeerAddress:
    """``name=host:port`` (the ``--peer`` flag) as a :class:`PeerAddress`."""
    name, sep, address = text.partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"a peer is name=host:port, got {text!r}")
    try:
        parse_hostport(address)
    except InvalidArgument as exc:
        raise ConfigError(f"peer {name!r}: {exc}") from exc
    return PeerAddress(name.strip(), address)


@dataclass(frozen=True)
class PeerAddress:
    name: str
    address: str  # host:port of the peer daemon's control listener


@dataclass(frozen=True)
class DaemonConfig:
    #: this node's name in the cluster (default: the host name)
    node: str = field(default_factory=socket.gethostname)
    #: unix socket clients connect to (created mode 0600)
    socket: str = "/run/p2pxfer/p2pxfer.sock"
    #: host:port of the daemon-to-daemon control listener (port 0: any free one)
    control: str = "127.0.0.1:0"
    #: libfabric provider for data ("tcp;ofi_rxm", "shm", "verbs;ofi_rxm", "efa")
    provider: str = "tcp;ofi_rxm"
    #: local address the fabric binds to (IP providers); empty: every interface
    fabric_node: str = ""
    #: use only these interfaces / domains, in this order (empty: all found)
    interfaces: tuple[str, ...] = ()
    #: "LOW-HIGH": the TCP ports the fabric listens on (one per rail; tcp
    #: provider), so a firewall can open exactly these; empty: ephemeral ports
    fabric_ports: str = ""
    #: largest protocol frame accepted, bytes
    max_frame: int = 16 << 20
    #: structlog level
    log_level: str = "INFO"
    #: "console" (key=value lines) or "json" (one object per line)
    log_format: str = "console"
    #: host:port to serve Prometheus metrics on (empty: no metrics)
    metrics: str = ""
    #: peers known from the start (more can be added at run time)
    peers: tuple[PeerAddress, ...] = ()
    #: uids allowed on the unix socket besides the daemon's own (and root)
    allowed_uids: tuple[int, ...] = ()
    #: membership backend: "none" (static peers only), "embedded" (SWIM over
    #: UDP on the control host:port) or "etcd"
    membership: str = "none"
    #: shared secret of the cluster (required unless membership is "none")
    cluster_token: str = ""
    #: a file holding the cluster token (instead of cluster_token)
    cluster_token_file: str = ""
    #: mutual TLS 1.3 on the control port (all three or none): the cluster
    #: CA's certificate(s), this node's certificate (naming ``node``) and its key
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    #: control addresses ("host:port") of members to join through (embedded)
    seeds: tuple[str, ...] = ()
    #: etcd's client URL (membership = "etcd")
    etcd_endpoint: str = "http://127.0.0.1:2379"
    #: etcd lease, seconds: a member that stops renewing it (killed, cut off)
    #: is seen dead about this long after (membership = "etcd")
    etcd_ttl: int = 5
    #: control connections served at once, in all and from one source address
    #: (more are closed at once, unread)
    max_connections: int = 256
    max_connections_per_host: int = 64
    #: of those, connections whose caller has not authenticated yet, in all
    #: and from one source range (an IPv4 /24, an IPv6 /64, all of loopback):
    #: past either, the oldest such connection is closed to make room
    max_pending_connections: int = 64
    max_pending_per_range: int = 16
    #: clients connected to the unix socket at once
    max_clients: int = 256
    #: ``wait_imm`` calls one client may have waiting at once (more: ``limit``)
    max_waiters_per_client: int = 4096
    #: caps per client and per uid (root and the daemon's uid have no per-uid
    #: caps); each refusal is the error ``limit`` naming its key: clients of
    #: one uid connected at once
    max_clients_per_uid: int = 64
    #: requests in flight (those that run as tasks: write, wait_imm, kv_push...)
    max_requests_per_client: int = 1024
    max_requests_per_uid: int = 4096
    #: bytes of shared memory mapped (per uid: with ranges still held after release)
    max_mapped_per_client: int = 1 << 40
    max_mapped_per_uid: int = 4 << 40
    #: exports, receiving KV pools included (each holds one of 4095 immediate slots)
    max_exports_per_client: int = 1024
    max_exports_per_uid: int = 1024
    #: a client of another uid than root's and the daemon's that holds nothing
    #: (no memory, no request in flight) and sends nothing for this long is
    #: closed, seconds (0: never)
    client_idle_s: float = 600.0
    #: peers the table may hold (configured, added, learnt from callers)
    max_peers: int = 4096
    #: immediates at most this many bytes wide: 4 runs tcp and shm as EFA and
    #: verbs run (4 bytes of CQ data: 20-bit values, KV counted per request);
    #: 0: as wide as the provider carries
    imm_bytes: int = 0
    #: a write's deadline, seconds: a write whose pieces are not all
    #: acknowledged by then (a silent peer, a cut rail) is torn down and fails
    #: with ``transfer_failed``, naming the pieces known to have landed
    write_timeout_s: float = 60.0
    #: take clients' device (CUDA) memory as is (``share_device``, direct KV
    #: pools): ask the provider for FI_HMEM. Where it has none (tcp; a
    #: libfabric built without CUDA, as Debian's), device memory is refused
    #: with ``device`` and clients stage it through host memory instead
    hmem: bool = False
    #: a write is done only once the target has its bytes (FI_DELIVERY_COMPLETE):
    #: without it, tcp calls a write done once its bytes are in a kernel socket,
    #: and a link cut right after leaves an "ok" write's tail undelivered until
    #: the link heals, or for ever. Costs a round trip per write
    delivery_complete: bool = False
    #: a rail pair with pieces in flight and no completion for this long,
    #: while another pair to the same peer works, is taken down and its
    #: notify and plain writes move to the other pairs (failover). On an
    #: overloaded host a healthy pair can look stalled: raise it there
    rail_stall_s: float = 1.5
    #: a write into a region exported by a client of this same daemon is a
    #: copy between the two shared mappings, not a trip through the provider
    #: (false: every write goes through the engine)
    local_copy: bool = True
    #: threads one large (>= 4 MiB) same-daemon copy is split over; 0: half
    #: the CPUs of the daemon's first NUMA node (at least 1, at most 8)
    local_copy_threads: int = 0
    #: fault injection, for tests of what follows an unknown notification:
    #: "landed" (every notify write's notification lands, then its outcome is
    #: treated as unknown) or "lost" (it is not sent, and its outcome is
    #: treated as unknown); "" (the default): no fault
    fault_notify: str = ""

    @classmethod
    def from_toml(cls, path: str | Path) -> DaemonConfig:
        return cls.load(path)

    @classmethod
    def load(cls, path: str | Path | None, **overrides: Any) -> DaemonConfig:
        """The config in ``path`` (None: the defaults) with ``overrides`` (from
        the command line) replacing its keys, except ``peers``, which are added
        to the file's; ``cluster_token_file`` replaces a ``cluster_token``."""
        data: dict[str, Any] = {}
        if path is not None:
            try:
                data = tomllib.loads(Path(path).read_text())
            except OSError as exc:
                raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from exc
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc
        if "peers" in overrides:
            overrides["peers"] = [*_list("peers", data.get("peers", []), "tables"),
                                  *overrides["peers"]]
        if overrides.get("cluster_token_file"):
            data.pop("cluster_token", None)
        try:
            return cls.from_dict({**data, **overrides})
        except ConfigError as exc:
            if path is None:
                raise
            raise ConfigError(f"config {path}: {exc}") from exc

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DaemonConfig:
        known = {f.name for f in fields(cls)}
        if extra := sorted(set(data) - known):
            raise ConfigError(f"unknown config keys {extra}; known: {sorted(known)}")
        kw = {key: _CHECKS[key](key, value) for key, value in data.items()}
        token_file = kw.get("cluster_token_file", "")
        if token_file:
            if kw.get("cluster_token"):
                raise ConfigError("set cluster_token or cluster_token_file, not both")
            kw["cluster_token"] = _read_token(token_file)
        cfg = cls(**kw)
        cfg._check_membership()
        cfg._check_tls()
        cfg._check_fabric_ports()
        return cfg

    def _check_fabric_ports(self) -> None:
        from p2pxfer.fabric._ports import tcp_provider

        if self.fabric_ports and not tcp_provider(self.provider):
            raise ConfigError(f"fabric_ports is for the tcp provider (tcp;ofi_rxm): provider "
                              f"{self.provider!r} listens on no TCP port it governs; remove "
                              f"fabric_ports (--fabric-ports)")

    @property
    def tls(self) -> bool:
        """Mutual TLS on the control port."""
        return bool(self.tls_cert)

    def _check_tls(self) -> None:
        given = {k: getattr(self, k) for k in TLS_KEYS}
        if any(given.values()) and not all(given.values()):
            missing = [k for k, v in given.items() if not v]
            raise ConfigError(f"tls_ca, tls_cert and tls_key go together: set all three or "
                              f"none (missing: {', '.join(missing)})")

    def _check_membership(self) -> None:
        if self.membership == "none":
            return
        if not self.cluster_token:
            raise ConfigError(f"membership = {self.membership!r} needs a cluster_token "
                              f"(the same secret on every member)")
        if self.membership == "embedded" and parse_hostport(self.control)[0] in (
                "0.0.0.0", "::", ""):
            raise ConfigError("membership = 'embedded' needs a control address with a "
                              "specific host (it is the member's address)")


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read cluster_token_file {path}: "
                          f"{exc.strerror or exc}") from exc
    if not token:
        raise ConfigError(f"cluster_token_file {path} is empty")
    return token


# -- one check per key: the value as the dataclass holds it, or ConfigError --------

def _str(key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{key} must be a string, got {v!r}")
    return v


def _nonempty(key: str, v: Any) -> str:
    if not _str(key, v).strip():
        raise ConfigError(f"{key} must not be empty")
    return str(v)


def _node_name(key: str, v: Any) -> str:
    """A node's name: peers and clients refuse longer ones on the wire."""
    s = _nonempty(key, v)
    if len(s) > MAX_NAME:
        raise ConfigError(f"{key} must be at most {MAX_NAME} characters, got {len(s)}")
    return s


def _int(key: str, v: Any, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{key} must be an integer, got {v!r}")
    if v < low:
        raise ConfigError(f"{key} must be >= {low}, got {v}")
    return v


def _seconds(key: str, v: Any, allow_zero: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) \
            or not (v >= 0 if allow_zero else v > 0) or v > 86400:
        least = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key} must be a number of seconds {least}, got {v!r} (at most a day)")
    return float(v)


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key} must be true or false, got {v!r}")
    return v


def _one_of(key: str, v: int, allowed: tuple[int, ...]) -> int:
    if v not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, allowed))}, got {v}")
    return v


def _choice(key: str, v: Any, choices: tuple[str, ...], fold: bool = False) -> str:
    s = _str(key, v)
    s = s.upper() if fold else s
    if s not in choices:
        raise ConfigError(f"{key} must be one of {list(choices)}, got {v!r}")
    return s


def _hostport(key: str, v: Any, allow_empty: bool = False) -> str:
    s = _str(key, v)
    if allow_empty and not s:
        return s
    try:
        parse_hostport(s)
    except InvalidArgument as exc:
        raise ConfigError(f"{key}: {exc}") from exc
    return s


def _list(key: str, v: Any, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise ConfigError(f"{key} must be a list of {what}, got {v!r}")
    return v


def _strs(key: str, v: Any) -> tuple[str, ...]:
    items = _list(key, v, "strings")
    for x in items:
        if not isinstance(x, str) or not x:
            raise ConfigError(f"{key} must be a list of strings, got the item {x!r}")
    return tuple(items)


def _uids(key: str, v: Any) -> tuple[int, ...]:
    items = _list(key, v, "numeric uids")
    for x in items:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ConfigError(f"{key} must be a list of numeric uids (e.g. [1000]), "
                              f"got the item {x!r}")
    return tuple(items)


def _seeds(key: str, v: Any) -> tuple[str, ...]:
    items = _strs(key, v)
    for s in items:
        _hostport(key, s)
    return items


def _peers(key: str, v: Any) -> tuple[PeerAddress, ...]:
    shape = "an array of tables ([[peers]] with name = \"...\" and address = \"host:port\")"
    if not isinstance(v, list):
        raise ConfigError(f"{key} must be {shape}, got {v!r}")
    out: list[PeerAddress] = []
    for p in v:
        if isinstance(p, PeerAddress):  # from the command line, already checked
            out.append(p)
            continue
        if not isinstance(p, dict) or set(p) != {"name", "address"}:
            raise ConfigError(f"{key} must be {shape}, got the item {p!r}")
        name = _nonempty(f"{key}.name", p["name"])
        out.append(PeerAddress(name, _hostport(f"peer {name!r} address", p["address"])))
    names = [p.name for p in out]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"{key}: names listed twice: {dup}")
    return tuple(out)


def _port_range(key: str, v: Any) -> str:
    s = _str(key, v)
    if s:
        from p2pxfer.fabric._ports import parse_port_range

        try:
            parse_port_range(s)
        except InvalidArgument as exc:
            raise ConfigError(f"{key}: {exc}") from exc
    return s


def _url(key: str, v: Any) -> str:
    s = _str(key, v)
    if not s.startswith(("http://", "https://")):
        raise ConfigError(f"{key} must be an http(s):// URL, got {v!r}")
    return s


_CHECKS: dict[str, Any] = {
    "node": _node_name,
    "socket": _nonempty,
    "control": _hostport,
    "provider": _nonempty,
    "fabric_node": _str,
    "interfaces": _strs,
    "fabric_ports": _port_range,
    "max_frame": lambda k, v: _int(k, v, 4096),
    "log_level": lambda k, v: _choice(k, v, LOG_LEVELS, fold=True),
    "log_format": lambda k, v: _choice(k, v, LOG_FORMATS),
    "metrics": lambda k, v: _hostport(k, v, allow_empty=True),
    "peers": _peers,
    "allowed_uids": _uids,
    "membership": lambda k, v: _choice(k, v, MEMBERSHIP_BACKENDS),
    "cluster_token": _str,
    "cluster_token_file": _str,
    "tls_ca": _str,
    "tls_cert": _str,
    "tls_key": _str,
    "seeds": _seeds,
    "etcd_endpoint": _url,
    "etcd_ttl": lambda k, v: _int(k, v, 1),
    "max_connections": lambda k, v: _int(k, v, 1),
    "max_connections_per_host": lambda k, v: _int(k, v, 1),
    "max_pending_connections": lambda k, v: _int(k, v, 1),
    "max_pending_per_range": lambda k, v: _int(k, v, 1),
    "max_clients": lambda k, v: _int(k, v, 1),
    "max_waiters_per_client": lambda k, v: _int(k, v, 1),
    "max_clients_per_uid": lambda k, v: _int(k, v, 1),
    "max_requests_per_client": lambda k, v: _int(k, v, 1),
    "max_requests_per_uid": lambda k, v: _int(k, v, 1),
    "max_mapped_per_client": lambda k, v: _int(k, v, 4096),
    "max_mapped_per_uid": lambda k, v: _int(k, v, 4096),
    "max_exports_per_client": lambda k, v: _int(k, v, 1),
    "max_exports_per_uid": lambda k, v: _int(k, v, 1),
    "client_idle_s": lambda k, v: _seconds(k, v, allow_zero=True),
    "max_peers": lambda k, v: _int(k, v, 1),
    "imm_bytes": lambda k, v: _one_of(k, _int(k, v, 0), (0, 4, 8)),
    "write_timeout_s": _seconds,
    "local_copy": _bool,
    "local_copy_threads": lambda k, v: _int(k, v, 0),
    "delivery_complete": _bool,
    "hmem": _bool,
    "rail_stall_s": _seconds,
    "fault_notify": lambda k, v: _choice(k, v, ("", "landed", "lost")),
}
assert set(_CHECKS) == {f.name for f in fields(DaemonConfig)}, "a config key has no check"
