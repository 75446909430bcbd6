"""``p2pxfer bench --via-daemon`` against daemons that have a cluster token.

The C baseline writes into the peer's region straight from the bench
process, with the descriptor asked of the peer daemon's control port; a
daemon with a ``cluster_token`` answers only a caller that proves it, so the
bench dials like a daemon (``dial_peer``) with the token from
``P2PXFER_CLUSTER_TOKEN``. Two daemons on 127.0.0.1 (tcp), tiny sizes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from click.testing import CliRunner, Result

from p2pxfer import connect
from p2pxfer.bench._server import TOKEN_ENV, resolve_region
from p2pxfer.cli import main
from p2pxfer.errors import AuthenticationFailed, UnknownRegion
from p2pxfer.testing import LOOPBACK, DaemonProc, free_port, start_daemon

TOKEN = "bench-cluster-token"
FAST = ["--warmup", "1", "--iterations", "3", "--memcpy-size", "8MiB", "--quiet"]


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """node-b, and node-a with node-b as its peer; both hold the token."""
    b = start_daemon(tmp_path, "b", control_port=free_port(), cluster_token=TOKEN)
    try:
        a = start_daemon(tmp_path, "a", control_port=free_port(), cluster_token=TOKEN,
                         peers=[{"name": "b", "address": b.control}])
        try:
            yield a, b
        finally:
            a.stop()
    finally:
        b.stop()


def bench(*args: str) -> Result:
    return CliRunner().invoke(main, ["bench", *args], catch_exceptions=False)


def test_via_daemon_with_a_cluster_token(pair: tuple[DaemonProc, DaemonProc], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    js = tmp_path / "d.json"

    def run() -> Result:
        return bench("--via-daemon", "--socket", a.socket, "--peer", "b", "--region", "kv",
                     "--size", "256KiB", "--json", str(js), *FAST)

    async def with_region() -> Result:
        async with connect(b.socket) as cb:
            await cb.export("kv", await cb.alloc(1 << 20))
            return await trio.to_thread.run_sync(run)

    r = trio.run(with_region)
    assert r.exit_code == 0, r.output
    assert "no C baseline" not in r.output, r.output
    (rec,) = json.loads(js.read_text())
    assert (rec["mode"], rec["target"]) == ("via-daemon", "b:kv")
    assert rec["gbps"] > 0
    assert rec["baseline_gbps"] > 0  # b's control port answered the bench: it proved the token
    assert a.alive() and b.alive()


def test_resolve_region_proves_the_token(pair: tuple[DaemonProc, DaemonProc]) -> None:
    """The bench's question itself: with the token, a descriptor (or the
    daemon's own ``unknown_region``); without it, or with another token, a
    refusal that says so, and the daemon serves on."""
    _, b = pair

    async def main() -> None:
        async with connect(b.socket) as cb:
            await cb.export("kv", await cb.alloc(1 << 16))
            desc = await resolve_region(b.control, "kv", 10, peer="b", token=TOKEN)
            assert desc.length == 1 << 16 and desc.node == "b"
            with pytest.raises(UnknownRegion, match="no region named 'nope'"):
                await resolve_region(b.control, "nope", 10, peer="b", token=TOKEN)
            with pytest.raises(AuthenticationFailed, match="requires the cluster token"):
                await resolve_region(b.control, "kv", 10, peer="b", token="")
            with pytest.raises(AuthenticationFailed, match="did not prove the cluster token"):
                await resolve_region(b.control, "kv", 10, peer="b", token="a-guess")
            with pytest.raises(AuthenticationFailed, match="says it is 'b'"):
                await resolve_region(b.control, "kv", 10, peer="c", token=TOKEN)
            assert (await cb.status())["node"] == "b"

    trio.run(main)
    assert b.alive()
    assert LOOPBACK in b.control
