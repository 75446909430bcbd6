"""Importing p2pxfer leaves the process's signal handlers as they were, and
Ctrl-C in the middle of writes reaches Python: ``KeyboardInterrupt`` in a
blocking caller, a clean cancellation in an async one (``finally`` runs).

Debian's libfabric loads ``libinfinipath``, which installs C handlers for
SIGINT, SIGTERM and SIGSEGV when it is loaded; ``p2pxfer.fabric._signals``
puts the previous ones back. Each check runs in a child process (a signal
is process-wide) on a real loopback transfer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# The child loops writes until it is interrupted; every wait is bounded.
READY_TIMEOUT = 60.0
EXIT_TIMEOUT = 30.0

COMPARE = """
import ctypes, signal, sys
libc = ctypes.CDLL(None)
def raw(sig):
    buf = ctypes.create_string_buffer(512)
    libc.sigaction(sig, None, buf)
    # handler, the mask's first 64 bits, the flags less SA_RESTORER (libc's own)
    return buf.raw[0:16], int.from_bytes(buf.raw[136:140], sys.byteorder) & ~0x04000000
SIGS = [signal.SIGINT, signal.SIGTERM, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL,
        signal.SIGABRT, signal.SIGUSR1]
before = {s: raw(s) for s in SIGS}
py_before = signal.getsignal(signal.SIGINT)
import p2pxfer, p2pxfer.fabric  # loads libfabric
changed = [signal.Signals(s).name for s in SIGS if raw(s) != before[s]]
assert not changed, f"importing p2pxfer changed the handlers of {changed}"
assert signal.getsignal(signal.SIGINT) is py_before
print("same")
"""

BLOCKING = """
import numpy as np
from p2pxfer import BlockingEngine, ScatterList
t = BlockingEngine.open("tcp;ofi_rxm", node="127.0.0.1")
i = BlockingEngine.open("tcp;ofi_rxm", node="127.0.0.1")
dst = t.export(np.zeros(1 << 24, np.uint8), "r")
src = np.ones(1 << 24, np.uint8)
i.register(src)
sl = ScatterList.contiguous(1 << 24)
try:
    i.write(src, dst, sl)
    print("ready", flush=True)
    while True:
        i.write(src, dst, sl, timeout=30)
except KeyboardInterrupt:
    print("interrupted", flush=True)
finally:
    i.close(); t.close()
    print("cleaned", flush=True)
"""

ASYNC = """
import numpy as np, trio
from p2pxfer import ScatterList
from p2pxfer.engine import EngineConfig, open_engine
async def main():
    cfg = EngineConfig(provider="tcp;ofi_rxm", node="127.0.0.1")
    async with open_engine(cfg) as t, open_engine(cfg) as i:
        dst = t.export(np.zeros(1 << 24, np.uint8), "r")
        src = np.ones(1 << 24, np.uint8)
        i.register(src)
        sl = ScatterList.contiguous(1 << 24)
        try:
            await i.write(src, dst, sl)
            print("ready", flush=True)
            while True:
                await i.write(src, dst, sl, timeout=30)
        finally:
            print("cleaned", flush=True)
try:
    trio.run(main)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


# The child handles Ctrl-C as an interactive program does: a suite started
# in the background by a non-interactive shell (CI, `cmd &`) hands its
# children SIGINT ignored, and Python then installs no handler at all. A
# child that does not exit in time is asked for every thread's stack
# (SIGUSR1: faulthandler), so the failure says where it hung.
STACKS = ("import faulthandler, signal; faulthandler.register(signal.SIGUSR1, all_threads=True)"
          "; signal.signal(signal.SIGINT, signal.default_int_handler)\n")


def run_child(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", STACKS + textwrap.dedent(code)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_import_keeps_signal_handlers() -> None:
    done = subprocess.run([sys.executable, "-c", COMPARE], check=False, capture_output=True,
                          text=True,
                          timeout=READY_TIMEOUT)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-2000:]


@pytest.mark.parametrize("code", [BLOCKING, ASYNC], ids=["blocking", "trio"])
def test_ctrl_c_in_a_write_loop_raises_keyboard_interrupt(code: str) -> None:
    child = run_child(code)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # bounded: the child writes with timeouts
        assert line.strip() == "ready", child.stderr.read() if child.stderr else ""
        os.kill(child.pid, signal.SIGINT)
        try:
            out, err = child.communicate(timeout=EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.kill(child.pid, signal.SIGUSR1)
            time.sleep(2)
            child.kill()
            out, err = child.communicate()
            pytest.fail(f"no exit {EXIT_TIMEOUT:g} s after SIGINT; stdout {out!r}; the "
                        f"child's threads:\n{err[-6000:]}")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    lines = out.split()
    assert "interrupted" in lines and "cleaned" in lines, (child.returncode, out, err[-3000:])
    assert child.returncode == 0, (out, err[-3000:])
