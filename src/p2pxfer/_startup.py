"""Starting the daemon from the command line: the config from a file plus
flags, checks of what the daemon is about to take (ports, the socket path,
hosts) before anything opens, and every startup failure turned into one line
that names what failed and where.

The checks here are a courtesy, not the authority: the daemon still fails
if a port is taken between the check and its bind, and :func:`one_line`
then names the failure from the exception alone. What must not live here:
the daemon's own logic (``p2pxfer.daemon``) and option parsing (the CLI's).
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator

from p2pxfer.daemon import DaemonConfig
from p2pxfer.daemon._config import parse_hostport
from p2pxfer.daemon._daemon import check_exposure
from p2pxfer.errors import ConfigError, P2PXferError, StartupError

__all__ = ["check_startup", "leaves", "one_line"]

# sun_path is 108 bytes on Linux, one of them the terminating NUL
MAX_SOCKET_PATH = 107


def check_startup(cfg: DaemonConfig) -> None:
    """Raise :class:`StartupError` for the first thing that would stop ``cfg``'s
    daemon from starting: a host that does not resolve, a port in use, a socket
    directory that cannot be created or written, a socket another daemon holds;
    and :class:`ConfigError` for TLS files that are not right (naming the file),
    for listening off loopback without credentials, or for a ``fabric_ports``
    range this machine cannot give."""
    _check_fabric_ports(cfg)  # first: no fabric call of this process may come before
    if cfg.tls:
        from p2pxfer.daemon._tls import config_tls

        config_tls(cfg)
    host, port = parse_hostport(cfg.control)
    _check_port("control", host, port, udp=cfg.membership == "embedded")
    if cfg.metrics:
        mhost, mport = parse_hostport(cfg.metrics)
        _check_port("metrics", mhost, mport, udp=False)
    _check_socket(cfg.socket)
    if cfg.fabric_node:
        _resolve("fabric_node", cfg.fabric_node, 0)
    check_exposure(cfg)


def _check_fabric_ports(cfg: DaemonConfig) -> None:
    """The range set for this process's fabric, wide enough for this node's
    rails (one listening port each), with that many ports free."""
    if not cfg.fabric_ports:
        return
    from p2pxfer.daemon._ports import apply_fabric_ports
    from p2pxfer.fabric import getinfo
    from p2pxfer.fabric._ports import parse_port_range

    apply_fabric_ports(cfg)
    low, high = parse_port_range(cfg.fabric_ports)
    names = [i.domain_name for i in getinfo(cfg.provider, node=cfg.fabric_node or None)]
    if cfg.interfaces:
        names = [n for n in names if n in cfg.interfaces]
    need, size = max(1, len(names)), high - low + 1
    if size < need:
        raise ConfigError(f"fabric_ports {cfg.fabric_ports} has {size} port"
                          f"{'s' if size > 1 else ''} for {need} rails ({', '.join(names)}): "
                          f"the fabric listens on one port per rail; widen the range "
                          f"(--fabric-ports {low}-{low + need - 1} at least)")
    host = cfg.fabric_node or "0.0.0.0"
    busy, free = [], 0
    for port in range(low, high + 1):
        with socket.socket(_resolve("fabric_node", host, port)[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                busy.append(port)
                continue
        free += 1
        if free == need:
            return
    raise StartupError("fabric ports", f"{host}:{low}-{high}",
                       f"{need} rail{'s' if need > 1 else ''} need {need} free port"
                       f"{'s' if need > 1 else ''}, but {', '.join(map(str, busy))} "
                       f"{'is' if len(busy) == 1 else 'are'} in use (another daemon?); "
                       f"widen or move the range (fabric_ports, --fabric-ports)")


def _resolve(what: str, host: str, port: int) -> list[tuple[int, tuple[object, ...]]]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise StartupError(f"cannot resolve {what} host", repr(host),
                           exc.strerror or str(exc)) from exc
    return [(family, tuple(addr[:2])) for family, _t, _p, _c, addr in infos]


def _check_port(what: str, host: str, port: int, *, udp: bool) -> None:
    family, addr = _resolve(what, host, port)[0]
    if port == 0:
        return  # any free port: nothing to collide with
    kinds = [(socket.SOCK_STREAM, "tcp")] + ([(socket.SOCK_DGRAM, "udp")] if udp else [])
    for kind, proto in kinds:
        with socket.socket(family, kind) as s:
            # The same option trio's listeners use, so a port in TIME_WAIT passes.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                where = f"{host}:{port}" + ("/udp" if proto == "udp" else "")
                if exc.errno == errno.EADDRINUSE:
                    raise StartupError(f"{what} port", where,
                                       "already in use (another daemon?)") from exc
                raise StartupError(f"cannot bind {what} address", where,
                                   exc.strerror or str(exc)) from exc


def _check_socket(path: str) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise StartupError("socket path", path,
                           f"longer than {MAX_SOCKET_PATH} bytes (a unix socket limit)")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise StartupError("cannot create socket directory", directory,
                           exc.strerror or str(exc)) from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StartupError("socket directory", directory,
                           f"not writable by uid {os.getuid()}")
    if os.path.isdir(path):
        raise StartupError("socket path", path, "is a directory")
    if os.path.exists(path):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            try:
                s.connect(path)
            except OSError:
                return  # a stale socket of an earlier run: the daemon replaces it
        raise StartupError("socket", path, "another daemon is listening on it")


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside ``exc``'s (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            yield from leaves(sub)
    else:
        yield exc


def one_line(exc: BaseException, cfg: DaemonConfig) -> str:
    """What to tell the operator about a daemon that failed with ``exc``: one
    line naming what failed (ours first; then the OS's, with the path or the
    address it concerned)."""
    found = list(leaves(exc))
    for leaf in found:
        if isinstance(leaf, P2PXferError):
            return str(leaf)
    for leaf in found:
        if isinstance(leaf, OSError):
            where = leaf.filename or ""
            if not where and leaf.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                where = f"control {cfg.control} or metrics {cfg.metrics or '(off)'}"
            text = leaf.strerror or str(leaf)
            return f"daemon failed: {text}" + (f" ({where})" if where else "")
    leaf = found[0]
    return f"daemon failed: {type(leaf).__name__}: {leaf} (--debug shows the traceback)"
