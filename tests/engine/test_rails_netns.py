"""Two rails between two "hosts": one write striped over two veth NICs.

Namespaces A and B (``netns.two_hosts``) are joined by two veth pairs, so each
host has two NICs, each its own tcp domain. A target process in A opens an
engine on its two veths and exports a zeroed region; an initiator process in B
opens an engine on its two veths and writes a random scatter list into it.
The write must be spread over both NICs (each carries a good share of the
bytes), and the target's region must equal the image the test computes from
the same seed, byte for byte (checked through a digest).

The children talk to the test over stdin/stdout, one line per message
prefixed with ``P2P``; every read is bounded, and the children are killed
if anything fails, so the test cannot hang.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import pytest

from netns import Host, two_hosts
from p2pxfer.loopback import digest
from p2pxfer.scatter import ScatterList

pytestmark = pytest.mark.netns

TESTS_DIR = Path(__file__).resolve().parent  # this module: the children import its helpers
PROVIDER = "tcp;ofi_rxm"
REGION = 64 << 20
SOURCE = 16 << 20
PIECES = 4000
MAX_PIECE = 24 << 10
SEED = 0x2A11_0F
IMM = 0x7A11
TEST_TIMEOUT = 45.0  # the whole exchange, from the first process start


# -- the plan both sides derive from the seed -------------------------------------

def make_source(seed: int) -> npt.NDArray[np.uint8]:
    return np.random.default_rng([seed, 0]).integers(0, 256, SOURCE, dtype=np.uint8)


def make_scatter(seed: int) -> ScatterList:
    """``PIECES`` pieces of 1..``MAX_PIECE`` bytes (plus a few of 1 MiB, which the
    engine splits to balance the rails) at non-overlapping random places of the
    region, random source offsets, in random order."""
    rng = np.random.default_rng([seed, 1])
    length = rng.integers(1, MAX_PIECE + 1, PIECES, dtype=np.int64)
    length[:4] = 1 << 20
    slack = REGION - int(length.sum())
    gap = np.sort(rng.integers(0, slack + 1, PIECES, dtype=np.int64))
    dst = gap + np.cumsum(length) - length
    order = rng.permutation(PIECES)
    length, dst = length[order], dst[order]
    src = rng.integers(0, SOURCE - length + 1, dtype=np.int64)
    return ScatterList(src, dst, length)


def expected_image(seed: int) -> npt.NDArray[np.uint8]:
    source, sl = make_source(seed), make_scatter(seed)
    n = sl.length
    within = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    image = np.zeros(REGION, np.uint8)
    image[np.repeat(sl.dst, n) + within] = source[np.repeat(sl.src, n) + within]
    return image


# -- the children -------------------------------------------------------------------

#: the child's side of ``Child``'s line protocol (every child script has it):
#: ``say`` writes a ``P2P <kind> <value>`` line, ``read_line`` reads one command
CHILD_PROTOCOL = """\
def say(kind, value):
    print("P2P", kind, value, flush=True)

async def read_line():
    line = await trio.to_thread.run_sync(sys.stdin.readline)
    if not line:
        raise SystemExit("stdin closed")
    return line.strip()

"""

_PRELUDE = f"""\
import json, sys
sys.path[:0] = [{str(TESTS_DIR)!r}, {str(TESTS_DIR.parent)!r}]
import numpy as np
import trio
from p2pxfer.engine import EngineConfig, open_engine
from p2pxfer.loopback import digest
from p2pxfer.memory import RegionDescriptor

""" + CHILD_PROTOCOL + f"""\
CONFIG = EngineConfig(provider={PROVIDER!r}, interfaces=tuple(sys.argv[1].split(",")))
"""

TARGET = _PRELUDE + textwrap.dedent(f"""
    async def main():
        async with open_engine(CONFIG) as engine:
            say("nics", json.dumps([n.domain_name for n in engine.topology.nics]))
            region = np.zeros({REGION}, np.uint8)
            say("descriptor", engine.export(region, "kv").to_bytes().hex())
            imm, count = map(int, (await read_line()).split())
            with trio.fail_after(30):
                await engine.wait_imm(imm, count)
            say("digest", digest(region))
            await read_line()  # "bye": the initiator is done too

    trio.run(main)
""")

INITIATOR = _PRELUDE + textwrap.dedent(f"""
    from test_rails_netns import make_scatter, make_source

    async def main():
        source = make_source({SEED})
        scatter = make_scatter({SEED})
        async with open_engine(CONFIG) as engine:
            engine.register(source)
            desc = RegionDescriptor.from_bytes(bytes.fromhex(await read_line()))
            with trio.fail_after(30):
                pieces = await engine.write(source, desc, scatter, imm={IMM})
            st = engine.statistics()
            say("stats", json.dumps({{
                "pieces": pieces,
                "nics": {{n.name: {{"bytes": n.bytes, "pieces": n.pieces, "errors": n.errors}}
                         for n in st.nics}},
                "completed": st.completed, "failed": st.failed,
            }}))
            await read_line()  # "bye": keep the endpoint up until the target verified

    trio.run(main)
""")


class Child:
    """A Python process inside a namespace, spoken to in lines."""

    def __init__(self, name: str, host: Host, script: Path, log: Path) -> None:
        self.name = name
        self.log_path = log
        self._log = log.open("w")
        argv = host.exec_argv([sys.executable, str(script), ",".join(host.interfaces)])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True,
                         name=f"{name}-stdout").start()

    def _pump(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def expect(self, kind: str, deadline: float) -> str:
        """The value of the next ``P2P <kind> <value>`` line (other lines are skipped)."""
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(0.0, left))
            except queue.Empty:
                raise AssertionError(f"{self.name}: no {kind!r} within the time limit\n"
                                     + self.stderr_tail()) from None
            if line is None:
                self.proc.wait(5)
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}) before "
                                     f"sending {kind!r}\n" + self.stderr_tail())
            parts = line.rstrip("\n").split(" ", 2)
            if len(parts) == 3 and parts[0] == "P2P":
                if parts[1] != kind:
                    raise AssertionError(f"{self.name}: expected {kind!r}, got {line!r}")
                return parts[2]

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self, deadline: float) -> None:
        try:
            rc = self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit\n" + self.stderr_tail()) from None
        assert rc == 0, f"{self.name} exited with {rc}\n" + self.stderr_tail()

    def stderr_tail(self) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return f"--- {self.name} stderr ---\n{text[-4000:]}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with suppress(OSError):
                    stream.close()
        self._log.close()


@contextmanager
def child(name: str, host: Host, source: str, tmp_path: Path) -> Iterator[Child]:
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    c = Child(name, host, script, tmp_path / f"{name}.stderr")
    try:
        yield c
    finally:
        c.kill()  # no-op once it exited by itself


def test_write_stripes_over_two_veth_rails(tmp_path: Path) -> None:
    want = digest(expected_image(SEED))
    total = make_scatter(SEED).nbytes
    with two_hosts(rails=2) as (a, b), ExitStack() as stack:
        deadline = time.monotonic() + TEST_TIMEOUT
        target = stack.enter_context(child("target", a, TARGET, tmp_path))
        assert json.loads(target.expect("nics", deadline)) == list(a.interfaces)
        descriptor = target.expect("descriptor", deadline)
        initiator = stack.enter_context(child("initiator", b, INITIATOR, tmp_path))
        initiator.send(descriptor)
        stats: dict[str, Any] = json.loads(initiator.expect("stats", deadline))

        target.send(f"{IMM} {stats['pieces']}")
        got = target.expect("digest", deadline)
        for c in (target, initiator):
            c.send("bye")
        for c in (target, initiator):
            c.finish(deadline)

    nics = stats["nics"]
    assert sorted(nics) == sorted(b.interfaces), nics
    assert stats["completed"] == 1 and stats["failed"] == 0, stats
    assert all(n["errors"] == 0 for n in nics.values()), nics
    assert sum(n["bytes"] for n in nics.values()) == total, nics
    assert sum(n["pieces"] for n in nics.values()) == stats["pieces"], nics
    for name, n in nics.items():
        assert n["bytes"] >= total // 4, f"{name} carried only {n['bytes']} of {total} bytes"
    assert got == want, "the target's region differs from the expected image"
