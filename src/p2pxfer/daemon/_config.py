"""The daemon's configuration: a TOML file, every key documented here and in
``deploy/p2pxfer.toml``. Unknown keys are errors (a typo must not be ignored)."""

from __future__ import annotations

import socket
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from p2pxfer.errors import InvalidArgument

__all__ = ["DaemonConfig", "PeerAddress", "parse_hostport"]


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgument(f"{text!r} is not host:port")
    return host.strip("[]"), int(port)


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
            elif key in ("interfaces", "allowed_uids"):
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
        return cfg

    @staticmethod
    def _peer(p: Any) -> PeerAddress:
        if not isinstance(p, dict) or set(p) != {"name", "address"}:
            raise InvalidArgument(f"a peer is {{name = ..., address = 'host:port'}}, got {p!r}")
        parse_hostport(p["address"])
        return PeerAddress(str(p["name"]), str(p["address"]))
