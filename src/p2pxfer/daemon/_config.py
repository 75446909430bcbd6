"""The daemon's configuration: a TOML file, every key documented here and in
``deploy/p2pxfer.toml``. Unknown keys are errors (a typo must not be ignored)."""

from __future__ import annotations

import socket
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from p2pxfer.address import parse_hostport
from p2pxfer.errors import InvalidArgument

__all__ = ["MEMBERSHIP_BACKENDS", "DaemonConfig", "PeerAddress", "parse_hostport"]

MEMBERSHIP_BACKENDS = ("none", "embedded", "etcd")


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
    #: largest protocol frame accepted, bytes
    max_frame: int = 16 << 20
    #: structlog level
    log_level: str = "INFO"
    #: peers known from the start (more can be added at run time)
    peers: tuple[PeerAddress, ...] = ()
    #: uids allowed on the unix socket besides the daemon's own (and root)
    allowed_uids: tuple[int, ...] = ()
    #: membership backend: "none" (static peers only), "embedded" (SWIM over
    #: UDP on the control host:port) or "etcd"
    membership: str = "none"
    #: shared secret of the cluster (required unless membership is "none")
    cluster_token: str = ""
    #: control addresses ("host:port") of members to join through (embedded)
    seeds: tuple[str, ...] = ()
    #: etcd's client URL (membership = "etcd")
    etcd_endpoint: str = "http://127.0.0.1:2379"
    #: etcd lease, seconds: a member that stops renewing it (killed, cut off)
    #: is seen dead about this long after (membership = "etcd")
    etcd_ttl: int = 5
    #: immediates at most this many bytes wide: 4 runs tcp and shm as EFA and
    #: verbs run (4 bytes of CQ data: 20-bit values, KV counted per request);
    #: 0: as wide as the provider carries
    imm_bytes: int = 0

    @classmethod
    def from_toml(cls, path: str | Path) -> DaemonConfig:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgument(f"cannot read config {path}: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DaemonConfig:
        known = {f.name: f for f in fields(cls)}
        if extra := sorted(set(data) - set(known)):
            raise InvalidArgument(f"unknown config keys {extra}; known: {sorted(known)}")
        kw: dict[str, Any] = {}
        for key, value in data.items():
            if key == "peers":
                kw[key] = tuple(cls._peer(p) for p in value)
            elif key in ("interfaces", "allowed_uids", "seeds"):
                if not isinstance(value, list):
                    raise InvalidArgument(f"config {key} must be a list")
                kw[key] = tuple(value)
            else:
                default = known[key].default
                if default is not field and not isinstance(value, type(default)) and \
                        key != "node":
                    raise InvalidArgument(f"config {key} must be {type(default).__name__}, "
                                          f"got {value!r}")
                kw[key] = value
        cfg = cls(**kw)
        parse_hostport(cfg.control)
        if cfg.max_frame < 4096:
            raise InvalidArgument(f"max_frame {cfg.max_frame} is too small (>= 4096)")
        cfg._check_membership()
        if cfg.imm_bytes not in (0, 4, 8):
            raise InvalidArgument(f"config imm_bytes must be 0, 4 or 8, got {cfg.imm_bytes}")
        return cfg

    def _check_membership(self) -> None:
        if self.membership not in MEMBERSHIP_BACKENDS:
            raise InvalidArgument(f"config membership must be one of {list(MEMBERSHIP_BACKENDS)}, "
                                  f"got {self.membership!r}")
        for seed in self.seeds:
            if not isinstance(seed, str):
                raise InvalidArgument(f"config seeds are 'host:port' strings, got {seed!r}")
            try:
                parse_hostport(seed)
            except InvalidArgument as exc:
                raise InvalidArgument(f"config seeds: {exc}") from exc
        if self.membership == "none":
            return
        if not self.cluster_token:
            raise InvalidArgument(f"config membership = {self.membership!r} needs a "
                                  f"cluster_token (the same secret on every member)")
        if self.etcd_ttl < 1:
            raise InvalidArgument(f"config etcd_ttl must be >= 1 second, got {self.etcd_ttl}")
        if self.membership == "etcd" and not self.etcd_endpoint.startswith(
                ("http://", "https://")):
            raise InvalidArgument(f"config etcd_endpoint must be an http(s):// URL, got "
                                  f"{self.etcd_endpoint!r}")
        if self.membership == "embedded" and parse_hostport(self.control)[0] in (
                "0.0.0.0", "::", ""):
            raise InvalidArgument("config membership = 'embedded' needs a control address "
                                  "with a specific host (it is the member's address)")

    @staticmethod
    def _peer(p: Any) -> PeerAddress:
        if not isinstance(p, dict) or set(p) != {"name", "address"}:
            raise InvalidArgument(f"a peer is {{name = ..., address = 'host:port'}}, got {p!r}")
        parse_hostport(p["address"])
        return PeerAddress(str(p["name"]), str(p["address"]))
