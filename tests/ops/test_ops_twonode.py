"""The README's quick two-node setup: two daemons from flags alone (no config
file), a write from one to the other, the bytes checked."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

import p2pxfer
from daemon_helpers import LOOPBACK, DaemonProc, free_port, p2pxfer_cmd, wait_accepting
from p2pxfer.scatter import ScatterList


def flag_daemon(workdir: Path, name: str, port: int, peer: str, peer_port: int) -> DaemonProc:
    sock = str(workdir / f"{name}.sock")
    control = f"{LOOPBACK}:{port}"
    log = workdir / f"{name}.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            [*p2pxfer_cmd(), "daemon", "--node", name, "--socket", sock, "--control", control,
             "--fabric-node", LOOPBACK, "--peer", f"{peer}={LOOPBACK}:{peer_port}"],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)
    d = DaemonProc(name, sock, control, workdir / "(no config)", log, proc)
    try:
        wait_accepting(d)
    except BaseException:
        d.stop()
        raise
    return d


def test_two_nodes_from_flags(tmp_path: Path) -> None:
    port_a, port_b = free_port(), free_port()
    a = flag_daemon(tmp_path, "a", port_a, "b", port_b)
    try:
        b = flag_daemon(tmp_path, "b", port_b, "a", port_a)
        try:
            with p2pxfer.SyncClient(b.socket) as cb, p2pxfer.SyncClient(a.socket) as ca:
                dst = cb.alloc(1 << 20)
                cb.export("kv", dst)
                src = ca.alloc(1 << 20)
                src.array[:] = np.arange(1 << 20, dtype=np.uint32).astype(np.uint8)
                n = ca.write("b", "kv", ScatterList.contiguous(1 << 20), src=src, imm=1)
                cb.wait_imm(1, n)
                assert np.array_equal(dst.array, src.array)
            st = a.status()
            assert st["node"] == "a" and st["control"] == f"{LOOPBACK}:{port_a}"
            assert [p["name"] for p in st["peers"]] == ["b"]
            assert b.stop() == 0
        finally:
            b.stop()
        assert a.stop() == 0
    finally:
        a.stop()
