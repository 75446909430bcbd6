"""Rail-pair health (``engine._health.RailHealth``): when a pair counts as
stalled, how long a down pair is left alone, and how it comes back. Plain
logic on given times; the failovers it drives run for real in
``test_failover_netns.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from p2pxfer.engine._health import RailHealth
from p2pxfer.engine._owner import OwnershipError, ShardLock

PAIR = (0, b"peer-a")
OTHER = (1, b"peer-a")


@pytest.fixture(autouse=True)
def lock() -> Iterator[ShardLock]:
    """Health belongs to its shard's lock: the tests hold it, as the shard does."""
    lock = ShardLock()
    with lock:
        yield lock


def test_a_busy_pair_without_progress_stalls_after_stall_s(lock: ShardLock) -> None:
    h = RailHealth(lock, stall_s=1.5, retry_s=3.0, retry_max_s=20.0)
    assert h.stalled({PAIR: 10}, now=100.0) == []  # just became busy: its clock starts
    assert h.stalled({PAIR: 10}, now=101.0) == []
    h.touch(PAIR, now=101.2)  # a completion
    assert h.stalled({PAIR: 10}, now=102.6) == []
    assert h.stalled({PAIR: 10}, now=102.8) == [PAIR]
    # New posts count as progress too; an idle pair never stalls.
    assert h.stalled({PAIR: 11}, now=103.0) == []
    assert h.stalled({}, now=110.0) == []
    assert h.stalled({PAIR: 11}, now=110.1) == []


def test_a_down_pair_is_retried_later_and_later_until_it_works(lock: ShardLock) -> None:
    h = RailHealth(lock, stall_s=1.0, retry_s=2.0, retry_max_s=5.0)
    h.mark_down(PAIR, now=0.0, reason="no progress")
    assert h.state(PAIR, 1.9) == "down" and h.state(OTHER, 1.9) == "up"
    # Down: no write uses it; past its retry time, writes that can fail over
    # probe it, per-piece-immediate writes still keep off.
    assert not h.usable(PAIR, 1.9, probe=True)
    assert h.state(PAIR, 2.0) == "probing"
    assert h.usable(PAIR, 2.0, probe=True) and not h.usable(PAIR, 2.0, probe=False)
    h.mark_down(PAIR, now=2.5, reason="no progress again")  # the probe failed
    assert h.state(PAIR, 6.4) == "down" and h.state(PAIR, 6.5) == "probing"  # 4 s
    h.mark_down(PAIR, now=7.0, reason="and again")
    assert h.state(PAIR, 11.9) == "down" and h.state(PAIR, 12.0) == "probing"  # capped: 5 s
    h.touch(PAIR, now=12.1)  # a completion on the probe: up again, back-off reset
    assert h.state(PAIR, 12.1) == "up" and h.usable(PAIR, 12.1, probe=False)
    h.mark_down(PAIR, now=20.0, reason="once more")
    assert h.state(PAIR, 21.9) == "down" and h.state(PAIR, 22.0) == "probing"
    assert h.pairs[PAIR].downs == 4


def test_health_is_changed_only_under_its_shards_lock() -> None:
    """Another thread, or this one without the lock, cannot change it."""
    import threading

    lock = ShardLock()
    h = RailHealth(lock, stall_s=1.0, retry_s=2.0, retry_max_s=5.0)
    with lock:
        h.touch(PAIR, now=1.0)
        errors: list[BaseException] = []

        def other() -> None:
            try:
                h.mark_down(PAIR, now=2.0, reason="x")
            except OwnershipError as exc:
                errors.append(exc)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert len(errors) == 1 and "RailHealth.mark_down" in str(errors[0])
    with pytest.raises(OwnershipError, match="shard's lock"):
        h.touch(PAIR, now=3.0)
    assert h.usable(PAIR, 3.0, probe=False)  # reads need no lock
