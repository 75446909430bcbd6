"""The registration cache over real rails: hits, misses, LRU eviction, pinning,
statistics. Every registration here is a real ``fi_mr_reg`` on the provider.
The cache alone is tested over a bare rail; what writes do with it, through an
engine (``BlockingEngine``) whose cache holds two entries, read through the
engine's statistics."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from conftest import open_blocking, posted
from p2pxfer.engine import BlockingEngine, RailGroup
from p2pxfer.errors import RegistrationError, UnregisteredMemory
from p2pxfer.fabric import Rail
from p2pxfer.memory import CacheStats, LocalRegion, RegistrationCache
from p2pxfer.scatter import ScatterList


def bufs(n: int, size: int = 4096) -> list[np.ndarray]:
    return [np.zeros(size, np.uint8) for _ in range(n)]


@pytest.fixture
def cache(rail: Rail) -> Iterator[RegistrationCache]:
    """A cache of the engine's default size on a bare rail (closed before it)."""
    cache = RegistrationCache([rail])
    try:
        yield cache
    finally:
        cache.close()


@pytest.fixture
def small_cache(rail: Rail) -> Iterator[RegistrationCache]:
    """A two-entry cache on a bare rail (closed before the rail)."""
    cache = RegistrationCache([rail], max_entries=2)
    try:
        yield cache
    finally:
        cache.close()


@pytest.fixture
def small_engine(provider: tuple[str, str | None]) -> Iterator[BlockingEngine]:
    """An engine (one rail) whose cache holds two entries."""
    with open_blocking(*provider, cache_entries=2) as engine:
        yield engine


def registrations(engine: BlockingEngine) -> CacheStats:
    (stats,) = engine.statistics().registrations  # one shard here
    return stats


# -- hits and misses ------------------------------------------------------------

def test_hit_returns_the_same_region(cache: RegistrationCache) -> None:
    buf = np.zeros(1 << 16, np.uint8)
    first = cache.register(buf)
    assert isinstance(first, LocalRegion)
    assert first.address == buf.ctypes.data and first.length == buf.nbytes
    assert cache.register(buf) is first
    stats = cache.statistics()
    assert (stats.hits, stats.misses, stats.evictions, stats.entries) == (1, 1, 0, 1)
    assert stats.nbytes == buf.nbytes


def test_sub_buffer_of_a_registered_buffer_hits(cache: RegistrationCache) -> None:
    buf = np.zeros(1 << 16, np.uint8)
    region = cache.register(buf)
    assert cache.register(buf[100:200]) is region
    assert cache.register(buf[-1:]) is region
    assert cache.register(memoryview(buf)[4096:8192]) is region
    # Another view type over the same bytes: a uint64 view of the tail.
    assert cache.register(buf[8:].view(np.uint64)[:10]) is region
    assert cache.require(buf[5:6]) is region
    stats = cache.statistics()
    assert (stats.hits, stats.misses, stats.entries) == (4, 1, 1)


def test_distinct_or_partly_covered_buffers_miss(cache: RegistrationCache) -> None:
    buf = np.zeros(1 << 16, np.uint8)
    inner = cache.register(buf[1024:2048])
    other = cache.register(np.zeros(4096, np.uint8))
    # Reaches past the registered range on both sides: a new registration.
    outer = cache.register(buf[512:4096])
    assert len({id(inner), id(other), id(outer)}) == 3
    stats = cache.statistics()
    assert (stats.hits, stats.misses, stats.entries) == (0, 3, 3)


def test_read_only_registration_does_not_serve_writable(cache: RegistrationCache) -> None:
    buf = np.zeros(4096, np.uint8)
    ro = cache.register(buf)
    assert not ro.writable
    rw = cache.register(buf, writable=True)
    assert rw is not ro and rw.writable
    # A writable registration serves a read-only lookup too.
    assert cache.register(buf) is rw
    stats = cache.statistics()
    assert (stats.hits, stats.misses) == (1, 2)


def test_require_finds_registered_and_rejects_unregistered(cache: RegistrationCache) -> None:
    buf = np.zeros(4096, np.uint8)
    with pytest.raises(UnregisteredMemory, match="not registered"):
        cache.require(buf)
    region = cache.register(buf)
    assert cache.require(buf[10:20]) is region


# -- eviction ---------------------------------------------------------------------

def test_lru_eviction_past_max_entries(small_cache: RegistrationCache) -> None:
    a, b, c = bufs(3)
    ra, rb = small_cache.register(a), small_cache.register(b)
    rc = small_cache.register(c)
    assert ra.closed, "the least recently used entry goes first"
    assert not rb.closed and not rc.closed
    stats = small_cache.statistics()
    assert (stats.misses, stats.evictions, stats.entries, stats.nbytes) == (3, 1, 2, 2 * 4096)
    assert small_cache.lookup(a.ctypes.data, a.nbytes) is None
    with pytest.raises(UnregisteredMemory):
        small_cache.require(a)
    # Registering it again is a miss and evicts the next oldest (b).
    ra2 = small_cache.register(a)
    assert ra2 is not ra and not ra2.closed
    assert rb.closed and not rc.closed
    assert small_cache.statistics().evictions == 2


def test_a_hit_refreshes_recency(small_cache: RegistrationCache) -> None:
    a, b, c = bufs(3)
    ra, rb = small_cache.register(a), small_cache.register(b)
    assert small_cache.register(a) is ra  # a is now the most recent
    small_cache.register(c)
    assert rb.closed and not ra.closed
    stats = small_cache.statistics()
    assert (stats.hits, stats.misses, stats.evictions) == (1, 3, 1)


def test_eviction_past_max_bytes(rail: Rail) -> None:
    cache = RegistrationCache([rail], max_bytes=10_000)
    try:
        a, b, c = bufs(3)
        ra, rb = cache.register(a), cache.register(b)
        rc = cache.register(c)  # 12288 bytes > 10000: the oldest goes
        assert ra.closed and not rb.closed and not rc.closed
        assert cache.statistics().nbytes == 8192
    finally:
        cache.close()


def test_pinned_region_is_never_evicted(small_cache: RegistrationCache) -> None:
    pinned, *others = bufs(6)
    rp = small_cache.register(pinned, pin=True)
    regions = [small_cache.register(o) for o in others]
    assert not rp.closed and rp.pins == 1
    assert all(r.closed for r in regions[:-1]) and not regions[-1].closed
    assert small_cache.statistics().evictions == len(others) - 1
    assert small_cache.register(pinned) is rp
    # Unpinned, it becomes an ordinary entry again.
    small_cache.unpin(rp)
    assert rp.pins == 0 and not rp.closed
    small_cache.register(others[0])
    small_cache.register(others[1])
    assert rp.closed


def test_unpin_below_zero_is_an_error(small_cache: RegistrationCache) -> None:
    region = small_cache.register(np.zeros(64, np.uint8))
    with pytest.raises(RegistrationError, match="not pinned"):
        small_cache.unpin(region)


def test_unpinned_entries_are_evicted_around_pinned_ones(
    small_cache: RegistrationCache,
) -> None:
    a, b, c, d = bufs(4)
    ra = small_cache.register(a, pin=True)
    rb = small_cache.register(b, pin=True)
    small_cache.unpin(rb)  # evictable now, but the cache is not over capacity
    assert not rb.closed
    rc = small_cache.register(c)  # over: the oldest *unpinned* entry (b) goes, not a
    assert rb.closed and not ra.closed and not rc.closed
    small_cache.unpin(ra)
    assert not ra.closed, "unpinning alone does not evict while within capacity"
    rd = small_cache.register(d)  # a is now the oldest unpinned entry
    assert ra.closed and not rc.closed and not rd.closed
    assert small_cache.statistics().evictions == 2


def test_exported_region_survives_eviction_and_still_takes_writes(
    small_engine: BlockingEngine,
) -> None:
    t = small_engine
    target = np.zeros(1 << 16, np.uint8)
    desc = t.export(target, "kept")
    sources = [np.full(4096, i + 1, np.uint8) for i in range(5)]
    for s in sources:
        t.register(s)
    # Each source pushed out the one before it; the pinned export stayed.
    stats = registrations(t)
    assert (stats.evictions, stats.entries) == (len(sources) - 1, 2)
    # The last source is still registered: write it into the surviving export.
    n = t.write(sources[-1], desc, ScatterList.contiguous(4096, dst=1000), imm=42, timeout=10)
    t.wait_imm(42, n, timeout=10)
    assert (target[1000:5096] == 5).all()
    assert not target[:1000].any() and not target[5096:].any()
    assert posted(t) == n


def test_export_pins_and_names_its_registration(provider: tuple[str, str | None]) -> None:
    name, node = provider
    with RailGroup([Rail.open(name, node=node)], cache_entries=2) as group:
        target = np.zeros(1 << 16, np.uint8)
        group.export(target, "kept")
        exported = group.cache.require(target)
        assert exported.pins == 1 and exported.name == "kept"
        group.unexport("kept")
        assert exported.pins == 0 and not exported.closed


def test_evicted_region_cannot_be_a_source(small_engine: BlockingEngine) -> None:
    t = small_engine
    desc = t.export(np.zeros(8192, np.uint8), "dst")
    src = np.ones(4096, np.uint8)
    t.register(src)
    t.register(np.zeros(64, np.uint8))
    assert registrations(t).evictions == 1
    with pytest.raises(UnregisteredMemory, match="not registered"):
        t.write(src, desc, ScatterList.contiguous(16), imm=1)
    assert posted(t) == 0


def test_evicted_registration_cannot_be_a_source(provider: tuple[str, str | None]) -> None:
    # A registration handed out earlier and evicted since: named as deregistered.
    name, node = provider
    with RailGroup([Rail.open(name, node=node)], cache_entries=2) as group:
        desc = group.export(np.zeros(8192, np.uint8), "dst")
        region = group.register(np.ones(4096, np.uint8))
        group.register(np.zeros(64, np.uint8))
        assert region.closed
        with pytest.raises(UnregisteredMemory, match="deregistered"):
            group.prepare(region, desc, ScatterList.contiguous(16), 1, tid=1)


def test_write_pins_its_source_only_while_it_runs(small_engine: BlockingEngine) -> None:
    t = small_engine
    desc = t.export(np.zeros(8192, np.uint8), "dst")
    src = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096]
    t.register(src)
    for imm in (3, 4):  # still registered after the first write
        n = t.write(src, desc, ScatterList.contiguous(4096), imm=imm, timeout=10)
        t.wait_imm(imm, n, timeout=10)
    assert registrations(t).evictions == 0
    # Unpinned once the writes returned: the next registration evicts it.
    t.register(np.zeros(64, np.uint8))
    assert registrations(t).evictions == 1
    with pytest.raises(UnregisteredMemory):
        t.write(src, desc, ScatterList.contiguous(16), imm=5)


def test_release_deregisters_even_a_pinned_region(cache: RegistrationCache) -> None:
    buf = np.zeros(4096, np.uint8)
    region = cache.register(buf, pin=True)
    cache.release(region)
    assert region.closed
    assert cache.statistics().entries == 0
    with pytest.raises(UnregisteredMemory):
        cache.require(buf)
    cache.release(region)  # idempotent


def test_statistics_counts_and_is_frozen(small_cache: RegistrationCache) -> None:
    a, b, c = bufs(3, size=1000)
    small_cache.register(a)
    small_cache.register(a[10:])
    small_cache.register(b)
    small_cache.register(c)
    small_cache.register(c)
    stats = small_cache.statistics()
    assert (stats.hits, stats.misses, stats.evictions, stats.entries, stats.nbytes) == (
        2, 3, 1, 2, 2000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.hits = 0  # type: ignore[misc]
    # A snapshot: later activity does not change it.
    small_cache.register(a)
    assert stats.misses == 3 and small_cache.statistics().misses == 4


def test_close_deregisters_everything(rail: Rail) -> None:
    cache = RegistrationCache([rail])
    regions = [cache.register(b, pin=(i % 2 == 0)) for i, b in enumerate(bufs(4))]
    cache.close()
    assert all(r.closed for r in regions)
    assert cache.statistics().entries == 0 and cache.statistics().nbytes == 0


# -- known bug: a new registration can be evicted before it is returned ----------



def test_new_pinned_registration_survives_a_full_pinned_cache(
    small_cache: RegistrationCache,
) -> None:
    a, b, c = bufs(3)
    small_cache.register(a, pin=True)
    small_cache.register(b, pin=True)
    rc = small_cache.register(c, pin=True)
    assert not rc.closed


def test_export_into_a_full_pinned_cache_stays_registered(
    small_engine: BlockingEngine,
) -> None:
    t = small_engine
    t.export(np.zeros(64, np.uint8), "a")
    t.export(np.zeros(64, np.uint8), "b")
    third = np.zeros(4096, np.uint8)
    desc = t.export(third, "c")
    # The descriptor handed out for "c" must name a live registration: a write
    # into a deregistered key would vanish without an error.
    assert registrations(t).entries == 3
    src = np.full(4096, 7, np.uint8)
    t.register(src)
    n = t.write(src, desc, ScatterList.contiguous(4096), imm=9, timeout=10)
    t.wait_imm(9, n, timeout=10)
    assert (third == 7).all()
