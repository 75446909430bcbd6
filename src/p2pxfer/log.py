"""structlog setup for p2pxfer.

Library code only calls ``structlog.get_logger("p2pxfer.<component>")`` and
logs events named ``<noun>.<verb>`` (``transfer.complete``) with ids and
sizes. If the application has not configured structlog, importing p2pxfer
sends our events to stderr at WARNING and above, so a library never writes to
stdout. ``configure`` is what the CLI and daemon call.
"""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure", "ensure_default"]


def configure(level: str | int = "INFO", *, json: bool = False) -> None:
    """Log p2pxfer's events to stderr at ``level``, as text or JSON lines."""
    if isinstance(level, str):
        level = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def ensure_default() -> None:
    if not structlog.is_configured():
        configure(logging.WARNING)
