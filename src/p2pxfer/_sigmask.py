"""SIGINT and SIGTERM belong to the main thread.

The kernel hands a process's signal to any thread that does not block it. A
Ctrl-C that lands on one of our threads (an engine's poller, in C, or a
``BlockingEngine``'s trio thread) sets Python's flag but does not wake the
main thread, which may be blocked waiting for that very thread: the
``KeyboardInterrupt`` then waits for the write in flight to end, however long
that takes. Our threads block both signals while they run our code, so the
kernel delivers them to the main thread, which wakes at once. A thread taken
from trio's cache gets its mask back when it returns there.

What must not live here: any handler (the process's handlers are its own).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["MAIN_THREAD_SIGNALS", "main_thread_signals"]

MAIN_THREAD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextmanager
def main_thread_signals() -> Iterator[None]:
    """Block ``MAIN_THREAD_SIGNALS`` in this (non-main) thread meanwhile."""
    if threading.current_thread() is threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, MAIN_THREAD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
