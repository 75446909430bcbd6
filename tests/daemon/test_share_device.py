"""``share_device`` where the daemon cannot take device memory (no CUDA
here, a libfabric without it): every request gets a clear answer naming why
(``device``) or what was wrong with it (``bad_request``), nothing is held
after it, and the daemon goes on serving; and the client's checks before it
asks. The path that takes device memory runs on a GPU (``tests/gpu``).

Two real daemons (tcp;ofi_rxm on loopback): one as configured by default
(``hmem`` off), one asked for FI_HMEM, which Debian's libfabric does not
offer with tcp."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import trio

import p2pxfer
from p2pxfer.cuda import IPC_HANDLE_BYTES, UUID_BYTES
from p2pxfer.errors import DeviceError, InvalidArgument
from p2pxfer.kv_plan import KVLayout
from p2pxfer.testing import DaemonProc, RawConn, start_daemon

HANDLE, GPU = bytes(range(IPC_HANDLE_BYTES)), b"\x11" * UUID_BYTES
LAYOUT = KVLayout(2, 8, 4096)


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DaemonProc]]:
    work = tmp_path_factory.mktemp("share_device")
    plain = start_daemon(work, "plain")
    try:
        asked = start_daemon(work, "asked", hmem=True)
        try:
            yield {"plain": plain, "asked": asked}
        finally:
            asked.stop()
    finally:
        plain.stop()
    for d in (plain, asked):
        assert "request.crashed" not in d.log.read_text(), d.log_tail()


def ask(d: DaemonProc, **fields: Any) -> dict[str, Any]:
    """One raw ``share_device`` (fields as given), then a ``status`` on the
    same connection: the error frame of the first, and the second's result."""
    c = RawConn(d.socket)
    try:
        c.hello()
        c.send({"t": "share_device", "id": 1, **fields})
        answer = c.frame()
        c.send({"t": "status", "id": 2})
        status = c.frame()
    finally:
        c.sock.close()
    assert answer is not None and status is not None
    assert status["t"] == "ok" and status["id"] == 2, status
    assert status["result"]["device_memory"] is False
    return answer


@pytest.mark.parametrize(("which", "why"), [
    ("plain", "is not opened for it \\(config hmem = false\\)"),
    ("asked", "was not offered with FI_HMEM"),
])
def test_a_daemon_without_device_memory_says_why(daemons: dict[str, DaemonProc], which: str,
                                                 why: str) -> None:
    answer = ask(daemons[which], handle=HANDLE, offset=0, size=1 << 20, gpu=GPU)
    assert answer["t"] == "error" and answer["id"] == 1 and answer["code"] == "device", answer
    assert re.search(why, answer["message"]), answer["message"]
    assert "stage it through shared memory" in answer["message"]


@pytest.mark.parametrize(("fields", "what"), [
    ({"handle": HANDLE[:10], "offset": 0, "size": 4096, "gpu": GPU}, "handle must be 64 bytes"),
    ({"handle": HANDLE, "offset": 0, "size": 4096, "gpu": GPU[:3]}, "16-byte UUID"),
    ({"handle": HANDLE, "offset": -1, "size": 4096, "gpu": GPU}, "offset must be >= 0"),
    ({"handle": HANDLE, "offset": 0, "size": 0, "gpu": GPU}, "size > 0"),
    ({"handle": "not bytes", "offset": 0, "size": 4096, "gpu": GPU}, "handle"),
    ({"handle": HANDLE, "offset": 0, "gpu": GPU}, "size"),
])
def test_a_malformed_share_device_is_a_bad_request(daemons: dict[str, DaemonProc],
                                                   fields: dict[str, Any], what: str) -> None:
    for d in daemons.values():
        answer = ask(d, **fields)
        assert answer["t"] == "error" and answer["code"] == "bad_request", answer
        assert what in answer["message"], answer["message"]


async def _through_clients(d: DaemonProc) -> None:
    async with p2pxfer.connect(d.socket) as client:
        st = await client.status()
        assert st["device_memory"] is False
        with pytest.raises(InvalidArgument, match=r"takes device memory.*got host memory"):
            await client.share_device(np.zeros(4096, np.uint8))
        with pytest.raises(InvalidArgument, match=r"direct=True is for a device pool"):
            await client.kv_pool("direct-host", LAYOUT, direct=True)
        # A host pool as before, whatever ``direct`` says of device memory.
        pool = await client.kv_pool("host-pool", LAYOUT, direct=False)
        assert (pool.kind, pool.direct) == ("host", False)
        assert pool.array.nbytes == LAYOUT.nbytes


def test_client_checks_from_trio_and_asyncio(daemons: dict[str, DaemonProc]) -> None:
    trio.run(_through_clients, daemons["asked"])
    asyncio.run(_through_clients(daemons["plain"]))


def test_client_checks_blocking(daemons: dict[str, DaemonProc]) -> None:
    with p2pxfer.SyncClient(daemons["plain"].socket) as client:
        with pytest.raises(InvalidArgument, match="takes device memory"):
            client.share_device(bytearray(4096))
        with pytest.raises(InvalidArgument, match=r"direct=True is for a device pool"):
            client.kv_pool("direct-host", LAYOUT, direct=True)
        # The daemon's word, raised as the client's DeviceError.
        with pytest.raises(DeviceError, match="config hmem = false"):
            client._c.request("share_device", handle=HANDLE, offset=0, size=4096, gpu=GPU)
        assert client.status()["clients"] >= 1

