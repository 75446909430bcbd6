"""Opening and closing an engine: ``open_engine(config)`` discovers the NICs
(``p2pxfer.topology``), opens one rail per NIC grouped into shards
(``open_engine_on`` takes the topology as given), starts each shard's poller
thread, and closes everything on exit, failing transfers still in flight with
``EngineClosed``. What must not live here: anything a running engine does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from p2pxfer.fabric import DELIVERY_COMPLETE, Rail
from p2pxfer.log import get_logger
from p2pxfer.topology import Topology, discover

from ._config import EngineConfig
from ._engine import Engine

__all__ = ["open_engine", "open_engine_on"]

log = get_logger("p2pxfer.engine")


@asynccontextmanager
async def open_engine(config: EngineConfig | None = None) -> AsyncIterator[Engine]:
    """Open an engine for the duration of the ``async with`` block."""
    config = config or EngineConfig()
    topo = discover(config.provider, node=config.node, sysfs_root=config.sysfs_root,
                    interfaces=list(config.interfaces) if config.interfaces else None,
                    numa_override=config.numa_override, hmem=config.hmem)
    async with open_engine_on(topo, config) as engine:
        yield engine


@asynccontextmanager
async def open_engine_on(topo: Topology, config: EngineConfig) -> AsyncIterator[Engine]:
    """An engine over the NICs of ``topo`` as given (``open_engine`` discovers
    them): a rail per NIC, a shard per topology shard. Tests use it to give a
    shard two rails on one interface, which discovery never offers."""
    token = trio.lowlevel.current_trio_token()
    engine = Engine(config, topo)
    shards = engine.shards
    started = 0
    try:
        for st in topo.shards:
            rails: list[Rail] = []
            try:
                for nic in st.nics:
                    assert nic.info is not None
                    info = nic.info
                    if config.delivery_complete:
                        info = info.with_tx_op_flags(DELIVERY_COMPLETE)
                    rail = Rail(info)
                    rails.append(rail)
                    rail.group = max(1, min(rail.group, config.write_group))
            except BaseException:
                for r in rails:
                    r.close()
                raise
            engine.add_shard(st, rails, token)
        for shard in shards:
            shard.start()
            started += 1
        log.info("engine.open", provider=config.provider, shards=len(shards),
                 nics=[n.domain_name for n in topo.nics])
    except BaseException:
        # Pollers already running read these CQs and fds: stopped first.
        with trio.CancelScope(shield=True):
            for shard in shards[:started]:
                shard.stop()
            for shard in shards[:started]:
                await shard.thread_done.wait()
        for shard in shards:
            shard.close()
        raise
    try:
        yield engine
    finally:
        await engine.aclose()
