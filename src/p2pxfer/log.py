"""structlog setup for p2pxfer.

Library code only calls ``get_logger("p2pxfer.<component>")`` (here) and
logs events named ``<noun>.<verb>`` (``transfer.complete``) with ids and
sizes. Importing p2pxfer configures nothing: while the application has not
configured structlog, our events go to stderr at WARNING and above through a
logger of our own (a library never writes to stdout, and never changes the
application's logging); once it has, they follow its configuration.
``configure`` is what the CLI and daemon call for their own process: text or
JSON lines, and a rate limit on repeats, so a peer that fails every retry
costs a few lines a window, not one per retry.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog

__all__ = ["RateLimiter", "configure", "get_logger"]

#: fields that tell two occurrences of an event apart for the rate limit
#: (the same event about another peer, region or client is not a repeat)
REPEAT_KEYS = ("peer", "region", "client", "rail", "code", "kind", "node", "remote")
BURST = 5  # lines per event and subject in one window
WINDOW_S = 10.0
#: levels never held back: failures, and DEBUG (asked for, so wanted whole)
UNLIMITED_LEVELS = frozenset({"debug", "error", "critical", "exception"})


#: longest text one field of a log line carries: fields may quote hostile
#: input (a client's region name), and a line, or a rate limiter's key, must
#: not hold megabytes of it
MAX_FIELD_CHARS = 1024
SUBJECT_CHARS = 256  # of a field, in a rate limiter's key


def cut_long_values(logger: Any, method: str,
                    event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: every str or bytes field past
    :data:`MAX_FIELD_CHARS` is cut there, saying how long it was."""
    for key, value in event.items():
        if type(value) is str and len(value) > MAX_FIELD_CHARS:
            event[key] = f"{value[:MAX_FIELD_CHARS]}... ({len(value)} characters)"
        elif type(value) is bytes and len(value) > MAX_FIELD_CHARS // 4:
            # its repr takes up to 4 characters a byte
            event[key] = f"{value[:MAX_FIELD_CHARS // 4]!r}... ({len(value)} bytes)"
    return event


def _subject(key: str, value: Any) -> str:
    """What a rate limiter tells lines apart by: a remote end by its host
    alone (a flood from one host comes from ever new ports)."""
    text = str(value)[:SUBJECT_CHARS]
    if key == "remote" and value is not None:
        return text.rsplit(":", 1)[0]
    return text


class RateLimiter:
    """A structlog processor: at most ``burst`` lines of one event about one
    subject (the :data:`REPEAT_KEYS` it carries) per ``window`` seconds; the
    first line after a window says how many were dropped (``suppressed``).
    Thread-safe: pollers log from their own threads."""

    def __init__(self, burst: int = BURST, window: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.window, self.clock = burst, window, clock
        self._lock = threading.Lock()
        # key -> [window start, lines in this window, dropped since last shown]
        self._seen: dict[tuple[Any, ...], list[float]] = {}

    def __call__(self, logger: Any, method: str,
                 event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if method in UNLIMITED_LEVELS:
            return event
        key = (method, event.get("event"), *(_subject(k, event.get(k)) for k in REPEAT_KEYS))
        now = self.clock()
        with self._lock:
            state = self._seen.get(key)
            if state is None or now - state[0] >= self.window:
                dropped = 0 if state is None else int(state[2])
                self._seen[key] = [now, 1, 0]
                if len(self._seen) > 4096:  # forget the oldest windows
                    for old in sorted(self._seen, key=lambda k: self._seen[k][0])[:1024]:
                        del self._seen[old]
                if dropped:
                    event["suppressed"] = dropped
                return event
            if state[1] < self.burst:
                state[1] += 1
                return event
            state[2] += 1
        raise structlog.DropEvent


def configure(level: str | int = "INFO", *, json: bool = False,
              rate_limit: bool = True) -> None:
    """Log p2pxfer's events to stderr at ``level``, as text or JSON lines,
    repeats held to :data:`BURST` per :data:`WINDOW_S` (unless ``rate_limit``
    is False)."""
    if isinstance(level, str):
        name = level.upper()
        if name not in logging.getLevelNamesMapping():
            raise ValueError(f"unknown log level {level!r}")
        level = logging.getLevelNamesMapping()[name]
    structlog.configure(
        processors=_processors(rate_limit, json),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def _processors(rate_limit: bool, json: bool) -> list[Any]:
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    out: list[Any] = [structlog.contextvars.merge_contextvars,
                      structlog.processors.add_log_level, cut_long_values]
    if rate_limit:
        out.append(RateLimiter())
    return [*out, structlog.processors.TimeStamper(fmt="iso", key="timestamp"), renderer]


@functools.cache
def _fallback(name: str) -> Any:
    """Our own logger for ``name`` while structlog is unconfigured: stderr,
    WARNING and above, repeats held back; structlog's global state untouched."""
    return structlog.wrap_logger(
        structlog.PrintLogger(file=sys.stderr), processors=_processors(True, False),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING), logger_name=name)


class _Logger:
    """A module's logger: the application's structlog once it configured
    one, our stderr fallback until then (checked per call, a flag read)."""

    __slots__ = ("_app", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._app: Any = None

    def __getattr__(self, method: str) -> Any:
        if self._app is None:
            if not structlog.is_configured():
                return getattr(_fallback(self._name), method)
            self._app = structlog.get_logger(self._name)
        return getattr(self._app, method)


def get_logger(name: str) -> Any:
    """The logger a p2pxfer module logs through (see the module's docstring)."""
    return _Logger(name)
