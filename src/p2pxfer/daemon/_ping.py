"""``ping``: proving that this daemon and a peer work together end to end,
step by step, and saying which step failed and where.

The steps: a control round trip to the peer (which answers with the
descriptor of a small scratch region of its own, never listed or
resolvable by name, and its rails); then, for each of the peer's rails, a
write of random bytes into that rail alone (so every rail pair that reaches
it carries a piece), checked by asking the peer for a digest of what
landed. A step that fails is probed with a plain TCP connect to the port it
needed, so a closed or filtered port is named. What must not live here: the
write path clients use (``_writes``), or the control port's dispatch
(``_control`` calls :meth:`Ping.answer`).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import socket
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from p2pxfer._pump import bounded
from p2pxfer.address import parse_hostport
from p2pxfer.errors import InvalidArgument, P2PXferError
from p2pxfer.fabric import parse_sockaddr
from p2pxfer.log import get_logger
from p2pxfer.memory import RegionDescriptor
from p2pxfer.scatter import ScatterList

from ._exports import RESERVED
from ._notes import rails

if TYPE_CHECKING:
    from p2pxfer.engine import Engine

    from ._peers import PeerTable

__all__ = ["PING_BYTES", "Ping"]

log = get_logger("p2pxfer.daemon")

#: the scratch region a peer's ping writes into (and the source of ours); a
#: ping takes one of its 32 KiB slots at random, so pings from several nodes
#: at once rarely meet
PING_BYTES = 1 << 20
#: bytes per piece; each rail's write is PIECES pieces, spread over its pairs
PIECE = 4096
PIECES = 8
#: how long a plain TCP connect to a port that a step needed may take
PROBE_S = 2.0
PING_TIMEOUT_S = 10.0
CHECK_AGAIN_S = 0.02


class Ping:
    """This daemon's side of ``ping``, both ways."""

    def __init__(self, node: str, engine: Engine, peers: PeerTable) -> None:
        self.node = node
        self.engine = engine
        self.peers = peers
        self._target: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self._desc: RegionDescriptor | None = None
        self._src: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self._lock = trio.Lock()

    # -- the peer's side: the control port's ``ping`` ----------------------------

    def answer(self, offset: int | None = None, length: int | None = None) -> dict[str, Any]:
        """Without a range: the scratch region's descriptor and our rails.
        With one: the BLAKE2b digest of those bytes of it."""
        if offset is None or length is None:
            return {"descriptor": self._scratch().to_wire(), "rails": rails(self.engine)}
        if not 0 <= offset < offset + length <= PING_BYTES:
            raise InvalidArgument(f"ping range {offset}+{length} is outside 0..{PING_BYTES}")
        self._scratch()
        assert self._target is not None
        return {"digest": hashlib.blake2b(self._target[offset:offset + length].tobytes()).digest()}

    def _scratch(self) -> RegionDescriptor:
        if self._desc is None:
            self._target = np.zeros(PING_BYTES, np.uint8)
            self._desc = self.engine.export(self._target, RESERVED)
        return self._desc

    # -- our side: the client's ``ping`` ---------------------------------------

    async def run(self, peer: str, timeout: float = PING_TIMEOUT_S) -> dict[str, Any]:
        """Every step against ``peer``, as far as they go; ``ok`` says whether
        all passed, ``failed`` names the first that did not."""
        if not peer:
            raise InvalidArgument("ping needs a peer: the node to check the way to")
        if not 0 < timeout <= 600:
            raise InvalidArgument(f"ping timeout must be in (0, 600] s, got {timeout:g}")
        link = self.peers.link(peer)  # UnknownPeer, naming the known ones
        out: dict[str, Any] = {"peer": peer, "node": self.node, "control": link.address,
                               "provider": self.engine.config.provider, "rails": [],
                               "ok": False}
        t0 = time.perf_counter()
        try:
            with trio.fail_after(timeout):
                hello = await self.peers.request(peer, "ping")
            desc = RegionDescriptor.from_wire(hello.get("descriptor"))
        except (P2PXferError, trio.TooSlowError) as exc:
            why = str(exc) if isinstance(exc, P2PXferError) else f"no answer within {timeout:g} s"
            out["failed"] = (f"control round trip to {peer} at {link.address}: {why}"
                             f"{await _probe(link.address)}")
            return out
        out["control_ms"] = round((time.perf_counter() - t0) * 1000, 3)
        names = {_plain(str(r.get("address", ""))): r.get("nic", "")
                 for r in hello.get("rails", [])}
        async with self._lock:  # one source buffer: pings from here take turns
            for index, rail in enumerate(desc.rails):
                where = _straddr(self.engine, rail.address)
                step = await self._rail(peer, desc, index, timeout)
                step.update(peer_rail=where, peer_nic=names.get(where, ""))
                out["rails"].append(step)
                if not step["ok"] and "failed" not in out:
                    probe = await _probe(_hostport(where)) if _hostport(where) else ""
                    out["failed"] = (f"write over peer rail {step['peer_nic'] or index} at "
                                     f"{where}: {step['error']}{probe}")
        out["ok"] = "failed" not in out
        log.info("ping.done", peer=peer, ok=out["ok"], failed=bounded(out.get("failed", ""), 300))
        return out

    async def _rail(self, peer: str, desc: RegionDescriptor, index: int,
                    timeout: float) -> dict[str, Any]:
        """A verified write into rail ``index`` of the peer's scratch alone."""
        engine = self.engine
        if self._src is None:
            self._src = np.zeros(PING_BYTES, np.uint8)
            engine.register(self._src)
        nbytes = PIECE * PIECES
        rng = np.random.default_rng()
        offset = int(rng.integers(0, PING_BYTES // nbytes)) * nbytes
        self._src[offset:offset + nbytes] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        want = hashlib.blake2b(self._src[offset:offset + nbytes].tobytes()).digest()
        one = dataclasses.replace(desc, rails=(desc.rails[index],))
        at = np.arange(PIECES, dtype=np.int64) * PIECE + offset
        before = {n.name: n.bytes for n in engine.statistics().nics}
        t0 = time.perf_counter()
        step: dict[str, Any] = {"ok": False, "bytes": nbytes}
        got: dict[str, Any] = {}
        try:
            await engine.write(self._src, one, ScatterList(at, at, np.full(PIECES, PIECE,
                                                                           np.int64)),
                               timeout=timeout)
            step["ms"] = round((time.perf_counter() - t0) * 1000, 3)
            # A completed write may still be on its way (tcp completes once
            # the bytes are in our socket): ask until they match, or time out.
            with trio.move_on_after(timeout):
                while True:
                    got = await self.peers.request(peer, "ping", offset=offset,
                                                     length=nbytes)
                    if got.get("digest") == want:
                        break
                    await trio.sleep(CHECK_AGAIN_S)
        except P2PXferError as exc:
            step["error"] = str(exc)
            return step
        step["via"] = sorted(n.name for n in engine.statistics().nics
                             if n.bytes > before.get(n.name, 0))
        if got.get("digest") != want:
            step["error"] = (f"the bytes in {peer}'s memory differ from the bytes written "
                             f"(still, {timeout:g} s after the write completed)")
            return step
        step["ok"] = True
        return step


def _straddr(engine: Engine, address: bytes) -> str:
    return _plain(engine.shards[0].memory.rails[0].av.straddr(address))


def _plain(text: str) -> str:
    """``host:port`` of an IP provider's address text; other text as it is."""
    ep = parse_sockaddr(text)
    return text if ep is None else f"{ep[0]}:{ep[1]}"


def _hostport(where: str) -> str:
    try:
        parse_hostport(where)
    except InvalidArgument:
        return ""
    return where


async def _probe(address: str) -> str:
    """What a plain TCP connect to ``address`` says, as advice (empty where
    it connects: the port is open, the trouble is elsewhere)."""
    try:
        host, port = parse_hostport(address)
    except InvalidArgument:
        return ""

    def connect() -> str:
        try:
            with socket.create_connection((host, port), timeout=PROBE_S):
                return ""
        except TimeoutError:
            return (f"; tcp port {port} on {host} does not answer within {PROBE_S:g} s: "
                    f"is it open in the firewall?")
        except OSError as exc:
            if exc.errno == errno.ECONNREFUSED:
                return (f"; tcp port {port} on {host} refuses connections: closed by a "
                        f"firewall, or nothing listens there")
            return f"; tcp port {port} on {host}: {exc.strerror or exc}"

    return await trio.to_thread.run_sync(connect)
