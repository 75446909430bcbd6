"""An unexport waits a while for the peers that resolved the region to hear
of it (``Regions.told``, awaited by ``Exports.remove``): once it has
answered, a reachable peer's next write resolves afresh and fails with
``unknown_region``, instead of going through the old key (whose bytes land
nowhere while the key lingers). A peer that does not answer is told later,
in the background; the unexport does not wait for it longer than
``TELL_WAIT_S``. In-process on trio's autojump clock, with a stand-in for
the peer links (``test_daemon.py::test_killed_target_region_is_unknown``
runs the real thing)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

from p2pxfer.daemon._regions import INVALIDATE_GIVE_UP_S, TELL_WAIT_S, Regions
from p2pxfer.errors import PeerUnreachable


class _Peers:
    """Peers that answer ``invalidate`` after ``delay[peer]`` (None: never)."""

    def __init__(self, delay: dict[str, float | None]) -> None:
        self.delay = delay
        self.heard: dict[str, float] = {}

    def __contains__(self, peer: str) -> bool:
        return peer in self.delay

    async def request(self, peer: str, kind: str, **fields: Any) -> dict[str, Any]:
        assert kind == "invalidate" and fields["region"] == "r"
        delay = self.delay[peer]
        if delay is None:
            await trio.sleep(0.5)
            raise PeerUnreachable(f"{peer}: no answer")
        await trio.sleep(delay)
        self.heard[peer] = trio.current_time()
        return {}


async def _gone_and_told(peers: _Peers, after: float = 0.0) -> tuple[float, set[str]]:
    """Time ``told`` took after the region went, with every peer having
    resolved it, and the regions still being told ``after`` seconds more."""
    exports = SimpleNamespace(on_remove=[], settle_remove=[])
    regions = Regions("node-b", peers, exports, lambda: None)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        regions.nursery = nursery
        for peer in peers.delay:
            regions._resolved_by.setdefault("r", set()).add(peer)
        t0 = trio.current_time()
        for hook in exports.on_remove:
            hook(SimpleNamespace(name="r"))
        for settle in exports.settle_remove:
            await settle("r")
        took = trio.current_time() - t0
        await trio.sleep(after)
        telling = set(regions._telling)
        nursery.cancel_scope.cancel()
    return took, telling


async def test_an_unexport_answers_once_the_peers_that_resolved_it_heard(
        autojump_clock: trio.testing.MockClock) -> None:
    peers = _Peers({"node-a": 0.05, "node-c": 0.2})
    took, telling = await _gone_and_told(peers)
    assert took == pytest.approx(0.2)
    assert telling == set()
    assert set(peers.heard) == {"node-a", "node-c"}


async def test_a_peer_that_does_not_answer_holds_an_unexport_up_only_a_while(
        autojump_clock: trio.testing.MockClock) -> None:
    peers = _Peers({"node-a": 0.05, "cut": None})
    took, telling = await _gone_and_told(peers)
    assert took == pytest.approx(TELL_WAIT_S)
    assert set(peers.heard) == {"node-a"}
    assert telling == {"r"}  # the cut peer is still being told


async def test_a_region_is_forgotten_once_its_last_peer_is_told_or_given_up(
        autojump_clock: trio.testing.MockClock) -> None:
    """Past ``told``'s wait the background goes on; when it ends, nothing
    of the region is kept (a daemon unexporting region after region beside
    a cut-off peer must not grow)."""
    peers = _Peers({"node-a": 0.05, "cut": None})
    _, telling = await _gone_and_told(peers, after=INVALIDATE_GIVE_UP_S + 5)
    assert telling == set()
