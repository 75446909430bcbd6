"""A fixed range for the TCP ports the fabric listens on, so a firewall can
be written for it.

libfabric's tcp provider (under ``tcp;ofi_rxm``) opens one listening
endpoint per rail; it takes the first free port of
``FI_TCP_PORT_LOW_RANGE``..``FI_TCP_PORT_HIGH_RANGE`` when both are set, an
ephemeral one otherwise. It reads the two once per process, when libfabric
starts (the first ``fi_getinfo``), so :func:`use_port_range` must run before
any fabric call of the process; :func:`listening_port` lets the caller check
afterwards that it did. What must not live here: deciding how many ports a
node needs (the daemon's startup checks).
"""

from __future__ import annotations

import os
import re

from p2pxfer.errors import InvalidArgument

from ._sockets import parse_sockaddr

__all__ = ["ENV_HIGH", "ENV_LOW", "listening_port", "parse_port_range", "tcp_provider",
           "use_port_range"]

ENV_LOW = "FI_TCP_PORT_LOW_RANGE"
ENV_HIGH = "FI_TCP_PORT_HIGH_RANGE"

_RANGE = re.compile(r"^\s*(\d{1,5})\s*-\s*(\d{1,5})\s*$")


def parse_port_range(text: str) -> tuple[int, int]:
    """``"7500-7531"`` as ``(7500, 7531)`` (both ends included)."""
    m = _RANGE.match(text)
    if m is None:
        raise InvalidArgument(f"a port range is LOW-HIGH, e.g. \"7500-7531\", got {text!r}")
    low, high = int(m.group(1)), int(m.group(2))
    if not 1 <= low <= high <= 65535:
        raise InvalidArgument(f"a port range is LOW-HIGH with 1 <= LOW <= HIGH <= 65535, "
                              f"got {text!r}")
    return low, high


def tcp_provider(provider: str) -> bool:
    """Whether ``provider`` listens on TCP ports that the range governs."""
    return provider.split(";", maxsplit=1)[0] == "tcp"


def use_port_range(low: int, high: int) -> None:
    """Have the tcp provider of this process listen within ``low..high``."""
    os.environ[ENV_LOW] = str(low)
    os.environ[ENV_HIGH] = str(high)


def listening_port(straddr: str) -> int | None:
    """The port of a rail's endpoint address (``fi_av_straddr`` text), or None
    where the address is not IP (shm)."""
    ep = parse_sockaddr(straddr)
    return None if ep is None else ep[1]
