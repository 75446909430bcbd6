"""The bench server (the target side) and the client's link to it.

For each provider a client asks for (a ``hello``), the server opens an engine
bound like the control socket (127.0.0.1 when it listens there), exports a
zeroed region of the size asked for, and hands over its ``RegionDescriptor``. The
client writes into it; after each measured point it says which immediate it
used and how many pieces carried it, and the server confirms once that many
have landed (``engine.wait_imm``). The engine's poller keeps the CQ
progressed meanwhile, as manual-progress providers need.

The handshake runs over TCP on the control port, in the protocol's framing
(``p2pxfer.protocol``: a msgpack map behind a 4-byte big-endian length).

    client -> server  {"t": "hello", "v": 1, "provider": str, "size": int, "rails": int,
                       "interfaces": [str] (optional: same-host runs)}
    server -> client  {"t": "ready", "descriptor": bytes, "rails": [str], "host": str}
    client -> server  {"t": "check", "imm": int, "count": int, "timeout": float}
    server -> client  {"t": "ok"}
    client -> server  {"t": "end"}      (this provider is done; another hello may follow)
    server -> client  {"t": "ok"}
    client -> server  {"t": "bye"}
    either way        {"t": "error", "message": str}

Also here: ``resolve_region``, the ``--via-daemon`` baseline's question to
the peer daemon's control port, asked like daemons ask each other
(``p2pxfer.daemon.dial_peer``, proving the cluster token from
``P2PXFER_CLUSTER_TOKEN`` when the daemons have one, and with TLS
credentials from ``P2PXFER_TLS_CA`` / ``_CERT`` / ``_KEY`` when they use TLS).

What must not live here: measuring (``_run``) and rendering.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import trio

from p2pxfer.buffers import SharedBuffer
from p2pxfer.engine import EngineConfig, open_engine
from p2pxfer.errors import ConfigError, P2PXferError
from p2pxfer.log import get_logger
from p2pxfer.loopback import loopback_node
from p2pxfer.memory import RegionDescriptor
from p2pxfer.plan import MEMORY
from p2pxfer.protocol import FrameDecoder, ProtocolError, encode_frame
from p2pxfer.topology import discover

from ._options import GIB, BenchError, format_size

if TYPE_CHECKING:
    from p2pxfer.daemon._tls import TlsCredentials

__all__ = ["PROTOCOL_VERSION", "TOKEN_ENV", "ServerConfig", "ServerLink", "bench_buffer",
           "connect_server",
           "fabric_node", "is_loopback", "pick_interfaces", "resolve_region", "serve"]

log = get_logger("p2pxfer.bench")

PROTOCOL_VERSION = 1
MAX_MESSAGE = 1 << 20


class ProtocolViolation(BenchError):
    """The other side sent something that is not a bench message."""


class Wire:
    """Bench messages over a trio stream, in the protocol's framing
    (``p2pxfer.protocol.encode_frame`` / ``FrameDecoder``)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._decoder = FrameDecoder(MAX_MESSAGE)

    async def send(self, kind: str, **fields: Any) -> None:
        try:
            frame = encode_frame({"t": kind, **fields}, MAX_MESSAGE)
        except ProtocolError as exc:
            raise ProtocolViolation(f"cannot send {kind!r}: {exc.message}") from exc
        await self.stream.send_all(frame)

    async def recv(self) -> dict[str, Any]:
        while True:
            try:
                msg = self._decoder.next_frame()
            except ProtocolError as exc:
                raise ProtocolViolation(exc.message) from exc
            if msg is not None:
                if not isinstance(msg.get("t"), str):
                    raise ProtocolViolation(f"expected a map with 't', got {msg!r:.80}")
                return msg
            data = await self.stream.receive_some(1 << 16)
            if not data:
                raise ProtocolViolation("the other side closed the connection")
            self._decoder.feed(data)


# -- server -------------------------------------------------------------------


@dataclass(frozen=True)
class ServerConfig:
    bind: str = "0.0.0.0"
    port: int = 7790
    #: local fabric address (IP providers); None lets the provider choose
    node: str | None = None
    #: providers clients may ask for; empty: any
    providers: tuple[str, ...] = ()
    #: NICs to export on; None: the first ``rails`` the client asks for
    interfaces: tuple[str, ...] | None = None
    max_region: int = 8 * GIB
    #: stop after the first client leaves
    once: bool = False
    #: longest nap of the target's poller where a CQ has no wait fd (shm). The
    #: target must progress its CQ for writes to land there, so a long nap is
    #: a floor under every small write's latency.
    backoff_max_ns: int = 100_000


def pick_interfaces(provider: str, node: str | None, rails: int,
                    interfaces: tuple[str, ...] | None) -> tuple[str, ...]:
    """The NICs to use: ``interfaces`` as given, else the first ``rails`` the
    provider offers at ``node``. Raises ``ProviderNotFound`` for an unknown
    provider and ``BenchError`` when there are too few NICs."""
    topo = discover(provider, node=node, interfaces=list(interfaces) if interfaces else None)
    names = tuple(n.domain_name for n in topo.nics)
    if interfaces:
        return names
    if rails > len(names):
        where = f" at {node}" if node else ""
        raise BenchError(f"{provider}{where} has {len(names)} interface(s) "
                         f"({', '.join(names)}); {rails} rails were asked for")
    return names[:rails]


def _hello_fields(msg: dict[str, Any], cfg: ServerConfig
                  ) -> tuple[str, int, int, tuple[str, ...] | None, bool]:
    if msg.get("t") != "hello" or msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolViolation(f"expected hello version {PROTOCOL_VERSION}, got "
                                f"{msg.get('t')!r} {msg.get('v')!r}")
    provider, size, rails = msg.get("provider"), msg.get("size"), msg.get("rails", 1)
    if not isinstance(provider, str) or not provider:
        raise ProtocolViolation("hello: provider must be a non-empty string")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ProtocolViolation("hello: size must be a positive integer")
    if not isinstance(rails, int) or isinstance(rails, bool) or rails <= 0:
        raise ProtocolViolation("hello: rails must be a positive integer")
    if size > cfg.max_region:
        raise BenchError(f"a {format_size(size)} region is over this server's limit of "
                         f"{format_size(cfg.max_region)}")
    if cfg.providers and provider not in cfg.providers:
        raise BenchError(f"this server offers {', '.join(cfg.providers)}, not {provider}")
    # A client on this same host may name the interfaces (loopback multi-rail
    # runs); the server's own --interfaces win.
    names = msg.get("interfaces")
    if names is not None and (not isinstance(names, list)
                              or not all(isinstance(n, str) and n for n in names)):
        raise ProtocolViolation("hello: interfaces must be a list of names")
    memory = msg.get("memory", "private")
    if memory not in MEMORY:
        raise ProtocolViolation(f"hello: memory must be {' or '.join(MEMORY)}")
    return (provider, size, rails, cfg.interfaces or (tuple(names) if names else None),
            memory == "shared")


def fabric_node(provider: str, node: str | None, peer_host: str | None,
                interfaces: tuple[str, ...] | None = None) -> str | None:
    """Local fabric bind address for ``provider``: ``node`` if given; else
    None when interfaces are named (they choose); else loopback when the other
    side is on loopback (so tcp stays on 127.0.0.1); else None (the
    provider's choice). Providers that are not IP-based get None."""
    if loopback_node(provider) is None:
        return None
    if node:
        return node
    if interfaces:
        return None
    if peer_host is None or is_loopback(peer_host):
        return loopback_node(provider)
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _serve_region(cfg: ServerConfig, wire: Wire, provider: str, size: int,
                        rails: int, interfaces: tuple[str, ...] | None,
                        shared: bool = False) -> bool:
    """One provider's engine and region (memfd pages where ``shared``), until
    the client says ``end`` (returns True: more may follow) or ``bye`` (False)."""
    node = fabric_node(provider, cfg.node, cfg.bind, interfaces)
    names = pick_interfaces(provider, node, rails, interfaces)
    config = EngineConfig(provider=provider, node=node, interfaces=names,
                          node_name=socket.gethostname(), backoff_max_ns=cfg.backoff_max_ns)
    async with AsyncExitStack() as stack:
        region = bench_buffer(size, shared, stack)  # freed after the engine closed
        engine = await stack.enter_async_context(open_engine(config))
        region.fill(0)  # fault the pages in now, not during the first transfer
        desc = engine.export(region, "bench")
        await wire.send("ready", descriptor=desc.to_bytes(), rails=list(names),
                        host=socket.gethostname())
        log.info("bench.session.ready", provider=provider, size=size, rails=names)
        while True:
            msg = await wire.recv()
            if msg["t"] == "bye":
                return False
            if msg["t"] == "end":
                await wire.send("ok")
                return True
            if msg["t"] != "check":
                raise ProtocolViolation(f"unexpected message {msg['t']!r}")
            imm, count = int(msg["imm"]), int(msg["count"])
            timeout = float(msg.get("timeout", 60.0))
            with trio.move_on_after(timeout):
                await engine.wait_imm(imm, count)
                await wire.send("ok")
                continue
            raise BenchError(f"only {engine.imm_count(imm)} of {count} pieces with "
                             f"immediate {imm} arrived within {timeout:g} s")
    raise AssertionError("unreachable")  # pragma: no cover (mypy: the stack may swallow)


def bench_buffer(size: int, shared: bool, stack: AsyncExitStack | ExitStack
                 ) -> npt.NDArray[np.uint8]:
    """``size`` bytes for one end of a bench transfer: anonymous memory, or
    where ``shared`` memfd pages (a ``SharedBuffer``, as a daemon's pools and
    its clients' shares are), closed with ``stack``."""
    if not shared:
        return np.empty(size, np.uint8)
    buf = SharedBuffer(size, "p2pxfer-bench")
    stack.callback(buf.close)
    return buf.array


async def _session(cfg: ServerConfig, stream: trio.SocketStream) -> None:
    wire = Wire(stream)
    try:
        while True:
            msg = await wire.recv()
            if msg["t"] == "bye":
                return
            provider, size, rails, interfaces, shared = _hello_fields(msg, cfg)
            if not await _serve_region(cfg, wire, provider, size, rails, interfaces, shared):
                return
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        log.info("bench.session.gone")
    except Exception as exc:  # one bad session must not stop the server
        log.warning("bench.session.failed", error=str(exc), type=type(exc).__name__)
        gone = isinstance(exc, ProtocolViolation) and "closed" in str(exc)
        if not gone:
            text = str(exc) if isinstance(exc, P2PXferError) else f"{type(exc).__name__}: {exc}"
            with trio.move_on_after(2), _quiet():
                await wire.send("error", message=text)
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


class _quiet:
    """Swallow a failure to send an error to a client that is already gone."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> bool:
        return exc_type is not None and issubclass(
            exc_type, trio.BrokenResourceError | trio.ClosedResourceError | OSError)


async def serve(cfg: ServerConfig, *,
                on_listen: Callable[[str, int], None] | None = None) -> None:
    """Serve bench clients until cancelled (or, with ``cfg.once``, until the
    first client leaves). ``on_listen(host, port)`` runs once listening."""
    listeners = await trio.open_tcp_listeners(cfg.port, host=cfg.bind)
    host, port = listeners[0].socket.getsockname()[:2]
    log.info("bench.server.listening", host=host, port=port)
    if on_listen is not None:
        on_listen(str(host), int(port))
    async with trio.open_nursery() as nursery:
        async def handle(stream: trio.SocketStream) -> None:
            await _session(cfg, stream)
            if cfg.once:
                nursery.cancel_scope.cancel()

        await trio.serve_listeners(handle, listeners, handler_nursery=nursery)


# -- client -------------------------------------------------------------------


class ServerLink:
    """The client's end of one session: a region on the server, and checks."""

    def __init__(self, wire: Wire, address: str, timeout: float) -> None:
        self.wire = wire
        self.address = address
        self.timeout = timeout
        self.descriptor: RegionDescriptor | None = None
        self.rails: list[str] = []
        self.host = ""

    async def _reply(self, what: str, grace: float = 0.0) -> dict[str, Any]:
        wait = self.timeout + grace
        try:
            with trio.fail_after(wait):
                msg = await self.wire.recv()
        except trio.TooSlowError:
            raise BenchError(f"bench server {self.address} did not answer {what} within "
                             f"{wait:g} s") from None
        except (trio.BrokenResourceError, OSError) as exc:
            raise BenchError(f"bench server {self.address} dropped the connection: "
                             f"{exc}") from exc
        if msg["t"] == "error":
            raise BenchError(f"bench server {self.address}: {msg.get('message')}")
        return msg

    @asynccontextmanager
    async def region(self, provider: str, size: int, rails: int,
                     interfaces: tuple[str, ...] | None = None, memory: str = "private"
                     ) -> AsyncIterator[RegionDescriptor]:
        """A region of ``size`` bytes on ``rails`` NICs of the server (or on
        ``interfaces``, for a server on this host), exported by an engine the
        server opens for ``provider`` until the block ends; of ``memory``
        (``private`` or ``shared``)."""
        extra: dict[str, Any] = {"interfaces": list(interfaces)} if interfaces else {}
        if memory != "private":  # sent only when asked for: the default needs no field
            extra["memory"] = memory
        await self.wire.send("hello", v=PROTOCOL_VERSION, provider=provider, size=size,
                             rails=rails, **extra)
        msg = await self._reply("hello")
        if msg["t"] != "ready" or not isinstance(msg.get("descriptor"), bytes):
            raise ProtocolViolation(f"expected ready, got {msg['t']!r}")
        self.descriptor = RegionDescriptor.from_bytes(msg["descriptor"])
        self.rails = [str(r) for r in msg.get("rails", [])]
        self.host = str(msg.get("host", ""))
        yield self.descriptor
        await self.wire.send("end")
        await self._reply("end")

    async def check(self, imm: int, count: int) -> None:
        """Return once the server has seen ``count`` pieces carrying ``imm``."""
        await self.wire.send("check", imm=imm, count=count, timeout=self.timeout)
        # The server waits up to ``timeout`` itself, then says why: give it time to.
        msg = await self._reply(f"check of immediate {imm}", grace=5.0)
        if msg["t"] != "ok":
            raise ProtocolViolation(f"expected ok, got {msg['t']!r}")


def _why(exc: OSError) -> str:
    """The words of the OS error underneath (trio groups one per address tried)."""
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        inner = [e for e in cause.exceptions if isinstance(e, OSError) and e.strerror]
        if inner:
            # "Error connecting to ('h', p): Connection refused" -> "connection refused"
            return "; ".join(sorted({str(e.strerror).rsplit(": ", 1)[-1].lower()
                                     for e in inner}))
    return exc.strerror or str(exc) or type(exc).__name__


@asynccontextmanager
async def connect_server(host: str, port: int, *, connect_timeout: float = 5.0,
                         timeout: float = 60.0) -> AsyncIterator[ServerLink]:
    """Connect to a bench server; ``BenchError`` within ``connect_timeout``
    seconds when it cannot be reached."""
    address = f"{host}:{port}"
    try:
        with trio.fail_after(connect_timeout):
            stream = await trio.open_tcp_stream(host, port)
    except trio.TooSlowError:
        raise BenchError(f"cannot reach the bench server at {address}: no answer within "
                         f"{connect_timeout:g} s") from None
    except OSError as exc:
        why = _why(exc)
        raise BenchError(f"cannot reach the bench server at {address}: {why} "
                         f"(is `p2pxfer bench --server` running there?)") from exc
    link = ServerLink(Wire(stream), address, timeout)
    try:
        yield link
        with trio.move_on_after(2), _quiet():
            await link.wire.send("bye")
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


# -- via-daemon: a region's descriptor from a peer daemon ---------------------------------

#: environment variable holding the cluster token (the daemons' ``cluster_token``)
TOKEN_ENV = "P2PXFER_CLUSTER_TOKEN"
#: environment variables naming the TLS files (as ``tls_ca``, ``tls_cert``,
#: ``tls_key``): a certificate of the cluster CA; the bench says its name
TLS_ENV = ("P2PXFER_TLS_CA", "P2PXFER_TLS_CERT", "P2PXFER_TLS_KEY")


def tls_from_env() -> TlsCredentials | None:
    """TLS credentials from ``TLS_ENV`` (all three or none: ``ConfigError``)."""
    from p2pxfer.daemon._tls import load_tls

    paths = [os.environ.get(k, "") for k in TLS_ENV]
    if not any(paths):
        return None
    if not all(paths):
        missing = [k for k, p in zip(TLS_ENV, paths, strict=True) if not p]
        raise ConfigError(f"set all of {', '.join(TLS_ENV)} or none (missing: "
                          f"{', '.join(missing)})")
    return load_tls(*paths)


async def resolve_region(address: str, region: str, timeout: float, *, peer: str | None = None,
                         token: str | None = None, tls: TlsCredentials | None = None
                         ) -> RegionDescriptor:
    """Ask the daemon at ``address`` (node ``peer``, when known) for the
    descriptor of its region ``region``, as peer daemons ask each other. With
    a cluster token (``token``, else ``$P2PXFER_CLUSTER_TOKEN``) both sides
    prove it first; a daemon that has one refuses a caller without it. With
    TLS credentials (``tls``, else from ``TLS_ENV``) the connection is mutual
    TLS, and the bench calls itself by its certificate's name."""
    from p2pxfer.daemon import dial_peer
    from p2pxfer.membership import ClusterAuth

    secret = os.environ.get(TOKEN_ENV, "") if token is None else token
    auth = ClusterAuth(secret.encode()) if secret else None
    creds = tls_from_env() if tls is None else tls
    name = creds.name if creds is not None else "p2pxfer-bench"
    with trio.fail_after(timeout):
        pump = await dial_peer(address, name=name, expect=peer, auth=auth, tls=creds)
        try:
            result = await pump.request("resolve", region=region)
            with trio.move_on_after(1), contextlib.suppress(P2PXferError):
                await pump.send("bye")
        finally:
            await pump.aclose()
    return RegionDescriptor.from_wire(result.get("descriptor"))
