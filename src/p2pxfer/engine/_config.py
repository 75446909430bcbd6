"""What an engine is opened with (``EngineConfig``) and what it reports
(``EngineStats``): plain frozen data, no behaviour. Both are re-exported by
``p2pxfer.engine``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from p2pxfer.memory import CacheStats

from ._state import NicStats

__all__ = ["EngineConfig", "EngineStats"]


@dataclass(frozen=True)
class EngineConfig:
    """How to open an engine. Every field has a working default for loopback."""

    provider: str = "tcp;ofi_rxm"
    #: local address to bind (IP providers); keeps tcp on loopback when "127.0.0.1"
    node: str | None = None
    #: use exactly these interfaces / domains (e.g. ["veth0", "veth1"]), in order
    interfaces: tuple[str, ...] | None = None
    #: NUMA node per interface, where sysfs is wrong or silent
    numa_override: Mapping[str, int] | None = None
    sysfs_root: str = "/sys"
    #: transfers queued or in flight per shard before ``write`` waits (backpressure)
    max_inflight: int = 256
    #: most pieces in flight to one peer over one NIC: a stalled peer then
    #: holds at most this much of a NIC's TX queue (tcp;ofi_rxm: 2048)
    peer_pieces: int = 512
    #: a write's deadline when its caller gives none (seconds; None: no
    #: deadline). When it passes the write is torn down (``TransferTimeout``)
    write_timeout_s: float | None = 60.0
    #: a cancelled write waits this long for its posted pieces before its
    #: connection is torn down (then ``Cancelled`` goes on)
    cancel_grace_s: float = 1.0
    #: poller spins this long after activity before sleeping on the CQ wait fd
    spin_ns: int = 20_000
    #: longest single sleep of an idle poller (a safety net: wake-ups come from
    #: the CQ wait fds and the submit eventfd)
    idle_timeout_ns: int = 50_000_000
    #: after posting a small write, the trio thread polls for its completion this
    #: long (blocking the event loop) before handing over to the poller thread;
    #: 0 turns it off
    inline_poll_ns: int = 50_000
    #: ... and a larger one, alone in flight on its shard, that long more per
    #: byte (``INLINE_NS_PER_KIB`` per KiB) up to this in all: a thread hop
    #: costs a 1 MiB write more than its transfer. 0: never beyond ``inline_poll_ns``
    inline_poll_max_ns: int = 1_000_000
    #: longest back-off nap where a CQ has no wait fd (shm)
    backoff_max_ns: int = 4_000_000
    #: a write completes only once the target placed it (FI_DELIVERY_COMPLETE):
    #: a write the target refuses (a closed or out-of-range registration) then
    #: fails here with ``TransferError`` instead of completing unnoticed. Costs
    #: a round trip per write (tcp: ~2x a small write's latency; shm: far more)
    delivery_complete: bool = False
    #: pieces without an immediate go out up to this many per RMA write, where
    #: the provider takes as many iovs (tcp;ofi_rxm and shm: 4): a message's
    #: fixed cost is paid per group. 1: one piece per write
    write_group: int = 4
    pin_threads: bool = True
    cache_entries: int = 1024
    node_name: str = ""
    incarnation: int = 0
    #: a (rail, peer rail) pair with pieces in flight and no completion for
    #: this long, while another pair to the same peer works, is taken down
    #: and its writes move to the peer's other pairs (failover)
    rail_stall_s: float = 1.5
    #: a pair that went down is tried again after this long, doubling (up to
    #: ``rail_retry_max_s``) while it keeps failing
    rail_retry_s: float = 3.0
    rail_retry_max_s: float = 60.0
    #: cap immediates at this many bytes (4: as EFA and verbs carry, also on
    #: tcp and shm, which carry 8, so 32-bit code paths run everywhere); 0:
    #: as wide as every rail carries
    imm_bytes: int = 0
    #: ask the provider for device memory (FI_HMEM), so CUDA memory is
    #: registered directly where it can be (``Engine.export`` of device
    #: memory); off by default: it can change how a provider moves host
    #: memory. Where the provider has none, the engine opens without it.
    hmem: bool = False


@dataclass(frozen=True)
class EngineStats:
    nics: tuple[NicStats, ...]
    #: transfers submitted and not yet ended, per shard
    in_flight: tuple[int, ...]
    completed: int
    failed: int
    cancelled: int = 0
    #: each shard's registration cache
    registrations: tuple[CacheStats, ...] = ()
    #: completions read by the trio thread polling small writes inline
    read_inline: int = 0
    #: completions read by the shards' poller threads
    read_by_pollers: int = 0
    #: immediate values some ``wait_imm`` is waiting for now
    imms_awaited: int = 0
    #: rail pairs taken down (errors or stalls), each moving its writes to
    #: the peer's other pairs; per pair state in ``NicStats.pairs``
    failovers: int = 0
    #: pieces posted again on another pair after theirs went down
    pieces_reposted: int = 0
    #: writes that took the express path (``engine/_express.py``) and
    #: completed on it, and those that became regular transfers on the way
    express: int = 0
    express_handed_over: int = 0
