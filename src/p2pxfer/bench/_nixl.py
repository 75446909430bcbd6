"""NIXL (vLLM's default disaggregation transfer library) as a peer row: the
same pages, the same run.

``NixlPeer`` runs NIXL's UCX backend without a GPU: a target process
registers a zeroed DRAM buffer and busy-polls its agent (``get_new_notifs``:
UCX needs the target to progress) while NIXL is set up and during NIXL's own
rounds only, and sleeps on its pipe otherwise, and neither agent runs
NIXL's progress thread: spinning through our rounds and the C reference's,
they took this machine's two cores from them (both ran at 0.2-0.3 of their
speed beside them), this process registers the source, and
each round is one transfer handle made before timing (``initialize_xfer``
with every page of the round as a descriptor; NIXL merges adjacent ones) and
posted again each time (``transfer``, then ``check_xfer_state`` until done).
UCX is held to loopback (``UCX_NET_DEVICES=lo``) over tcp for the tcp
providers and shared memory (``sm``) for ``shm``; its bundled ib and cuda
modules stay unloaded (the ib one crashes at exit here). The first block of
rounds is checked: the target compares every destination range with the
source's fill byte.

Optional: ``pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1`` (plain
``pip install nixl`` pulls torch and CUDA, ~6 GB). Where it is missing,
``nixl_missing`` says why and the bench leaves the row out with a note.
What must not live here: anything of ours on the data path.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from p2pxfer.memory import buffer_span
from p2pxfer.scatter import ScatterList

from ._options import BenchError
from ._reference import process_cpu_seconds
from ._spawned import SpawnedTarget

__all__ = ["INSTALL", "NixlPeer", "nixl_missing", "ucx_env"]

INSTALL = "pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1"
START_TIMEOUT = 60.0


def ucx_env(provider: str) -> dict[str, str]:
    """UCX's settings for a run beside ``provider``: loopback only."""
    return {"UCX_MODULES": "^ib,cuda", "UCX_NET_DEVICES": "lo", "UCX_LOG_LEVEL": "error",
            "UCX_TLS": "sm,self" if provider.startswith("shm") else "tcp"}


def nixl_missing(provider: str) -> str | None:
    """Why no NIXL row can run next to ``provider``, or None."""
    if not provider.startswith(("tcp", "shm")):
        return "NIXL's UCX backend is compared with tcp and shm providers only"
    try:
        importlib.import_module("nixl._api")
    except ImportError:
        return f"NIXL is not installed ({INSTALL})"
    return None


def _agent(name: str, provider: str) -> Any:
    for k, v in ucx_env(provider).items():
        os.environ[k] = v
    # Through importlib: an optional dependency without type information.
    api = importlib.import_module("nixl._api")
    # No progress thread: it ran beside every path of the run, ours and the C
    # reference's included, and took a core from them; NIXL progresses where
    # this bench calls it (the target's busy poll, check_xfer_state).
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False,
                                                       backends=[]))
    params = {} if provider.startswith("tcp") else {"ucx_error_handling_mode": "none"}
    agent.create_backend("UCX", params)
    return agent


def _register(agent: Any, buf: npt.NDArray[np.uint8]) -> int:
    address = buffer_span(buf).address
    agent.register_memory(agent.get_reg_descs([(address, buf.nbytes, 0, "")], "DRAM"))
    return address


def _target_main(conn: Any, size: int, provider: str) -> None:
    """Entry point of the NIXL target process: busy-polls until told to stop."""
    try:
        agent = _agent("p2pxfer-bench-target", provider)
        buf = np.zeros(size, np.uint8)
        address = _register(agent, buf)  # before the metadata, which carries it
        conn.send(("ready", agent.get_agent_metadata(), address))
        polling = True  # through the set-up (connections, handles)
        while True:
            if polling:
                agent.get_new_notifs()  # progress
                if not conn.poll(0):
                    continue
            msg = conn.recv()
            if msg[0] == "stop":
                conn.send(("stopped",))
                return
            if msg[0] == "poll":  # busy-poll from now (True) or sleep on the pipe
                polling = bool(msg[1])
                conn.send(("polling", polling))
                continue
            _, offsets, lengths, fill = msg  # check: every range holds the fill byte
            bad = sum(int(np.count_nonzero(buf[o:o + n] != fill))
                      for o, n in zip(offsets, lengths, strict=True))
            conn.send(("checked", bad))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


class NixlPeer:
    """NIXL writing from ``src`` into a target process's buffer of ``size``."""

    name = "nixl"

    def __init__(self, src: npt.NDArray[np.uint8], size: int, provider: str,
                 timeout: float) -> None:
        self._fill = int(src[0])
        self._target = SpawnedTarget(_target_main, (size, provider), "p2pxfer-nixl-target",
                                     "NIXL target")
        self._handles: list[Any] = []
        self._checked = False
        try:
            msg = self._target.reply(START_TIMEOUT, "start")
            self._agent = _agent("p2pxfer-bench", provider)
            self._src = _register(self._agent, src)
            self._remote = self._agent.add_remote_agent(msg[1])
            self._dst = int(msg[2])
        except BaseException:
            self.close()
            raise
        self._pid = self._target.pid
        self._timeout = timeout

    def plan(self, sl: ScatterList) -> tuple[Any, ScatterList]:
        """A transfer handle for the round, made before any timing."""
        zeros = np.zeros(len(sl), np.int64)
        local = np.stack([sl.src + self._src, sl.length, zeros], axis=1)
        remote = np.stack([sl.dst + self._dst, sl.length, zeros], axis=1)
        handle = self._agent.initialize_xfer(
            "WRITE", self._agent.get_xfer_descs(local, "DRAM"),
            self._agent.get_xfer_descs(remote, "DRAM"), self._remote)
        self._handles.append(handle)
        return handle, sl

    def _poll(self, on: bool) -> None:
        self._target.conn.send(("poll", on))
        self._target.reply(self._timeout, "start polling" if on else "stop polling")

    def block(self, plans: list[Any], timeout: float) -> tuple[int, list[float], float | None]:
        self._poll(True)
        try:
            return self._block(plans, timeout)
        finally:
            self._poll(False)  # others' rounds come next: leave them the CPU

    def _block(self, plans: list[Any], timeout: float) -> tuple[int, list[float], float | None]:
        cpu0 = process_cpu_seconds(self._pid)
        n, dts = 0, []
        for handle, sl in plans:
            t0 = time.perf_counter()
            state = self._agent.transfer(handle)
            while state != "DONE":
                if state == "ERR" or time.perf_counter() - t0 > timeout:
                    raise BenchError(f"a NIXL transfer of {len(sl)} pieces "
                                     f"{'failed' if state == 'ERR' else 'timed out'}")
                state = self._agent.check_xfer_state(handle)
            dts.append(time.perf_counter() - t0)
            n += len(sl)
        cpu = process_cpu_seconds(self._pid) - cpu0
        if not self._checked:  # the first block (the warm-up): were the bytes written?
            self._checked = True
            for _, sl in plans:
                self._target.conn.send(("check", sl.dst.tolist(), sl.length.tolist(),
                                        self._fill))
                bad = self._target.reply(timeout, "check the bytes")[1]
                if bad:
                    raise BenchError(f"NIXL's transfer left {bad} bytes of the target wrong")
        return n, dts, cpu

    def close(self) -> None:
        agent: Any = getattr(self, "_agent", None)
        for handle in self._handles if agent is not None else ():
            with contextlib.suppress(Exception):  # NIXL raises its own types
                agent.release_xfer_handle(handle)
        self._handles.clear()
        self._target.stop()

    def __enter__(self) -> NixlPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
