"""The README's quick two-node setup: two daemons from flags alone (no config
file), a write from one to the other, the bytes checked."""

from __future__ import annotations

import shutil
import subprocess
import sys
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


def readme_two_node_block() -> str:
    """The shell block of README.md's "Two nodes in a handful of commands"."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("### Two nodes in a handful of commands", 1)[1]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


def test_readme_two_node_block_works_when_pasted(tmp_path: Path) -> None:
    """The block as a reader pastes it (backgrounded daemons, then the client
    straight away), on free ports and sockets of this test's own."""
    block = readme_two_node_block()
    ports = {"7700": str(free_port()), "7701": str(free_port()), "9464": str(free_port())}
    for old, new in [*ports.items(), ("/tmp/a.sock", str(tmp_path / "a.sock")),
                     ("/tmp/b.sock", str(tmp_path / "b.sock")),
                     (".venv/bin/", str(Path(sys.executable).parent) + "/")]:
        assert old in block, f"the README's block no longer uses {old}"
        block = block.replace(old, new)
    # Daemons write to their own logs, so the block's output pipe closes with it.
    block = block.replace(" &\n", f" >>{tmp_path}/daemons.log 2>&1 &\n")
    block = block.replace("kill %1 %2", "kill %1 %2; wait")
    done = subprocess.run(["bash", "-c", block], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False)
    log = (tmp_path / "daemons.log").read_text(errors="replace")[-3000:]
    assert "landed: True" in done.stdout, (done.stdout[-3000:], done.stderr[-3000:], log)
    assert "p2pxfer_rail_bytes_total" in done.stdout or shutil.which("curl") is None
    assert done.returncode == 0, (done.stderr[-3000:], log)
