"""Shared fixtures: real libfabric providers on this machine, loopback only.

``tcp;ofi_rxm`` is always bound to 127.0.0.1 (``node=``) so no test traffic
leaves loopback; ``shm`` needs no address. No mocks: every fixture opens real
fabric objects and closes them afterwards.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from daemon_helpers import daemon_pair, free_port
from p2pxfer.engine import BlockingEngine, Engine, EngineConfig, open_engine
from p2pxfer.fabric import Rail
from p2pxfer.loopback import loopback_node
from p2pxfer.testing import DaemonProc

LOOPBACK = "127.0.0.1"

# (provider, node): what an engine or a rail needs to stay on this machine.
PROVIDERS: list[tuple[str, str | None]] = [("tcp;ofi_rxm", LOOPBACK), ("shm", None)]


def open_blocking(provider: str, node: str | None, **options: Any) -> BlockingEngine:
    """Open a blocking engine on ``provider`` (one rail here); tcp is pinned to
    loopback."""
    if provider.startswith("tcp") and node != LOOPBACK:
        raise AssertionError(f"tcp tests must bind {LOOPBACK}, got node={node!r}")
    return BlockingEngine.open(provider, node=node, **options)


def posted(engine: BlockingEngine) -> int:
    """Pieces this engine has posted over its life, all NICs together."""
    return sum(n.pieces for n in engine.statistics().nics)


def posted_bytes(engine: BlockingEngine) -> int:
    """Bytes this engine has posted over its life, all NICs together."""
    return sum(n.bytes for n in engine.statistics().nics)


@pytest.fixture(params=PROVIDERS, ids=[p for p, _ in PROVIDERS])
def provider(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """(provider name, node) for each real provider this machine has."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def engine(provider: tuple[str, str | None]) -> Iterator[BlockingEngine]:
    """A blocking engine on each provider, closed after the test."""
    with open_blocking(*provider) as e:
        yield e


@pytest.fixture
def rail(provider: tuple[str, str | None]) -> Iterator[Rail]:
    """One bare rail on each provider (for the layers below the engine)."""
    name, node = provider
    with Rail.open(name, node=node) as r:
        yield r


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240611)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real etcd on 127.0.0.1 (free ports, temporary data dir); its client URL.
    Shared by the membership backend and daemon tests."""
    import httpx  # only the etcd tests need it
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("no etcd binary on PATH (Debian: apt-get install etcd-server)")
    root = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
    url = f"http://{LOOPBACK}:{client}"
    log = (root / "etcd.log").open("wb")
    proc = subprocess.Popen(
        [binary, "--name", "test", "--data-dir", str(root / "data"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://{LOOPBACK}:{peer}",
         "--initial-advertise-peer-urls", f"http://{LOOPBACK}:{peer}",
         "--initial-cluster", f"test=http://{LOOPBACK}:{peer}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("etcd did not start: "
                                   + (root / "etcd.log").read_text(errors="replace")[-2000:])
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def engine_config(provider: str, **kw: Any) -> EngineConfig:
    """An engine config that keeps ``provider``'s traffic on this machine."""
    return EngineConfig(provider=provider, node=loopback_node(provider), **kw)


@asynccontextmanager
async def engine_pair(provider: str, receiver: dict[str, Any] | None = None,
                      **kw: Any) -> AsyncIterator[tuple[Engine, Engine]]:
    """Two engines in this process, ``(a, b)``, both on ``provider`` (loopback
    for IP providers). ``kw`` configures both, unless ``receiver`` gives ``b``
    options of its own."""
    async with open_engine(engine_config(provider, **kw)) as a, \
            open_engine(engine_config(provider, **(kw if receiver is None else receiver))) as b:
        yield a, b


async def wait_until(cond: Callable[[], bool], timeout: float, what: str, *,
                     interval: float = 0.001) -> float:
    """Poll ``cond`` every ``interval`` until it holds; the seconds it took.
    Fails (``AssertionError`` naming ``what``) after ``timeout``."""
    t0 = trio.current_time()
    with trio.move_on_after(timeout):
        while not cond():
            await trio.sleep(interval)
        return trio.current_time() - t0
    if cond():  # a stall of this thread may have spanned the deadline
        return trio.current_time() - t0
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


async def returns_without_blocking(fn: Callable[[], Awaitable[object]]) -> None:
    """Fail unless ``fn()`` ends without parking its task: run in a task of
    its own, it must be done by the time every task is blocked. A clock
    would misread a starved machine; a wait that parks (or naps on a timer)
    is still blocked then."""
    done = False

    async def run() -> None:
        nonlocal done
        await fn()
        done = True

    # Bounded: a wait that busy-checkpoints never lets every task block.
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await trio.testing.wait_all_tasks_blocked()
            blocked = not done
            nursery.cancel_scope.cancel()
    assert not blocked, f"{fn} blocked"


def inflight(engine: Engine) -> list[int]:
    """Pieces posted and not yet completed, per NIC."""
    return [n.inflight for n in engine.statistics().nics]


@contextmanager
def stalled(engine: Engine) -> Iterator[None]:
    """``stall(engine, ...)`` for the block, restarted however it ends."""
    stall(engine, True)
    try:
        yield
    finally:
        stall(engine, False)


def stall(engine: Engine, on: bool) -> None:
    """Stop (or restart) ``engine`` reading its CQs: on tcp it then receives
    nothing more once its socket buffers are full, so writes to it cannot
    finish however slowly the test runs."""
    for shard in engine.shards:
        shard._poller.hold(on)  # test-only reach: the way to make a peer mute


@pytest.fixture
def daemon_sockets(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Daemons node-a and node-b (``daemon_pair``: each the other's static
    peer), stopped at the test's end: their client sockets."""
    with daemon_pair(tmp_path) as (a, b):
        yield a.socket, b.socket


@pytest.fixture
def daemons() -> Iterator[list[DaemonProc]]:
    """Daemons a test starts (it appends them), stopped at its end."""
    started: list[DaemonProc] = []
    yield started
    for d in started:
        d.stop()


def run_child(ctx: Any, target: Any, *args: Any) -> tuple[int | None, Any]:
    """``target(*args, results)`` in a child process of ``ctx`` (a process
    that may crash: shm kills one that posts to a peer whose segment is
    gone): its exit code, and the first thing it put in ``results`` (None
    if nothing: a crash)."""
    results = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, results))
    child.start()
    got = None
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            try:
                got = results.get(timeout=0.2)
                break
            except queue.Empty:
                if child.exitcode is not None:
                    # Its last word may have been queued just before it
                    # exited; none at all means a crash.
                    with contextlib.suppress(queue.Empty):
                        got = results.get(timeout=5)
                    break
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(5)
    return child.exitcode, got
