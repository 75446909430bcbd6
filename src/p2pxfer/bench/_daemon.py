"""``--via-daemon``: our path is client -> local daemon -> peer daemon.

The source is shared memory allocated through the local daemon; the writes go
into a region a client exported on the peer. The reference writes the same
pattern into the same region from this process with the C initiator
(``reference = "c-initiator"``: the peer's daemon is the target, no C target
can run there), with the descriptor asked from the peer daemon's control port,
as peer daemons ask each other (``_server.resolve_region``: ``dial_peer``,
with the cluster token from ``$P2PXFER_CLUSTER_TOKEN`` and TLS credentials
from ``$P2PXFER_TLS_CA`` / ``_CERT`` / ``_KEY``). What must not live here:
measuring (``_measure``), options, rendering.
"""

from __future__ import annotations

import trio

from p2pxfer.errors import P2PXferError
from p2pxfer.memory import RegionDescriptor

from ._measure import Progress, Reference, connect_paths, measure_case
from ._options import BenchConfigError, BenchOptions, Case, format_size, parse_hostport
from ._paths import DaemonPath
from ._reference import ReferenceInitiator, close_rails, open_rails
from ._report import BenchResult
from ._server import fabric_node, pick_interfaces, resolve_region

__all__ = ["daemon_session"]

FILL = 0xA5


async def daemon_session(opts: BenchOptions, cases: list[Case], progress: Progress,
                         notes: list[str]) -> list[BenchResult]:
    from p2pxfer.client import connect

    async with connect(opts.socket) as client:
        status = await client.status()
        provider = str(status["provider"])
        peers = {p["name"]: p["address"] for p in await client.peers()}
        if opts.peer not in peers:
            raise BenchConfigError(f"the daemon at {opts.socket} knows no peer {opts.peer!r} "
                                   f"(known: {', '.join(sorted(peers)) or 'none'})")
        address = peers[opts.peer]
        dst: RegionDescriptor | None = None
        try:
            dst = await resolve_region(address, opts.region, opts.connect_timeout,
                                       peer=opts.peer)
        except (OSError, trio.TooSlowError, P2PXferError) as exc:
            why = str(exc) or type(exc).__name__
            notes.append(f"no C reference: could not ask {opts.peer} ({address}) for region "
                         f"{opts.region!r}: {why}")
        size = opts.region_bytes()
        if dst is not None and size > dst.length:
            raise BenchConfigError(f"region {opts.region!r} on {opts.peer} is "
                                   f"{format_size(dst.length)}; this pattern needs "
                                   f"{format_size(size)}")
        mem = await client.alloc(size, "p2pxfer-bench")
        mem.array.fill(FILL)
        ours = DaemonPath(client, mem, opts.peer, opts.region)
        target = f"{opts.peer}:{opts.region}"
        if dst is None:
            await connect_paths(ours, None, None, opts.timeout)
            return [await measure_case(c, ours, None, None, opts, provider, target, progress)
                    for c in cases]
        ref_provider = dst.rails[0].provider
        node = fabric_node(ref_provider, opts.node, parse_hostport(address)[0],
                           opts.interfaces)
        names = pick_interfaces(ref_provider, node, min(opts.nrails(), len(dst.rails)),
                                opts.interfaces)
        rails = open_rails(ref_provider, node, names)
        try:
            ini = ReferenceInitiator(rails, mem.array, dst)
            base = Reference(ini, None)
            await connect_paths(ours, base, None, opts.timeout)
            results = [await measure_case(c, ours, base, None, opts, provider, target, progress)
                       for c in cases]
            ini.close()
            return results
        finally:
            close_rails(rails)
