"""``host:port`` and sizes: the one parser of each for the whole package.

Everything that reads an address from a person or from the wire (the
daemon's config, a peer's ``hello``, ``add_peer``, the bench's ``--client``)
parses it here, strictly, so a bad one is refused where it arrives, with a
message that says what is wrong, instead of failing later inside a resolver.
What must not live here: resolving names or opening sockets.
"""

from __future__ import annotations

import ipaddress
import re

from p2pxfer.errors import InvalidArgument

__all__ = ["format_hostport", "parse_hostport", "parse_size"]

_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_PORT = re.compile(r"[0-9]{1,5}")


def _q(value: object) -> str:
    """``repr`` cut to a length fit for a message (input may be hostile)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"


def _check_host(text: str, host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    if not name:
        raise InvalidArgument(f"{_q(text)}: no host")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise InvalidArgument(f"{_q(text)}: {_q(host)} is neither an IP address nor a host name "
                              "(ASCII letters, digits, '-' and '_', labels of 1-63 "
                              "characters, at most 253 in all)")
    return host


def parse_hostport(text: str, *, default_port: int | None = None,
                   port_zero: bool = True) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6ADDR]:PORT`` or, with a ``default_port``, ``HOST``
    or ``[V6ADDR]`` alone. An IPv6 address without brackets is taken whole
    when a default port applies, else up to its last ``:`` (``::1:7700``).
    Port 0 ("any free one", for listeners) only with ``port_zero``. Raises
    ``InvalidArgument`` naming what is wrong."""
    if not isinstance(text, str):
        raise InvalidArgument(f"an address is a 'host:port' string, got {_q(text)}")
    raw = text.strip()
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0:
            raise InvalidArgument(f"{_q(text)}: unclosed '[' in address")
        host, rest = raw[1:end], raw[end + 1:]
        if rest and not rest.startswith(":"):
            raise InvalidArgument(f"{_q(text)} is not host:port")
        port_text: str | None = rest[1:] if rest else None
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise InvalidArgument(f"{_q(text)}: {_q(host)} in brackets is not an IPv6 "
                                  "address") from None
    elif raw.count(":") > 1:
        if default_port is not None and _is_v6(raw):
            host, port_text = raw, None
        else:
            host, _, port_text = raw.rpartition(":")
            if not _is_v6(host):
                raise InvalidArgument(f"{_q(text)} is not host:port (an IPv6 address goes "
                                      "in brackets: [::1]:7700)")
    else:
        host, sep, after = raw.partition(":")
        port_text = after if sep else None
    if port_text is None:
        if default_port is None:
            raise InvalidArgument(f"{_q(text)} is not host:port (no port)")
        port = default_port
    else:
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
        if not _PORT.fullmatch(port_text):
            raise InvalidArgument(f"{_q(text)}: port {_q(port_text)} is not a number "
                                  "in 0..65535")
        port = int(port_text)
    if not (0 if port_zero else 1) <= port < 65536:
        raise InvalidArgument(f"{_q(text)}: port must be a number in "
                              f"{0 if port_zero else 1}..65535, got {port}")
    return _check_host(text, host), port


def _is_v6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def format_hostport(host: str, port: int) -> str:
    """The inverse of ``parse_hostport``: IPv6 addresses in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
MAX_SIZE = 1 << 40
_UNITS = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB, "mib": MIB,
          "g": GIB, "gb": GIB, "gib": GIB}
_SIZE = re.compile(r"\s*(-?)\s*([0-9]{1,20})\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """``4096``, ``64KiB``, ``1M``, ``2GiB`` (units are binary; ``KB`` = ``KiB``)
    as a positive number of bytes, at most 1 TiB. Raises ``InvalidArgument``
    otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.fullmatch(str(text))
        if m is None or m[3].lower() not in _UNITS:
            raise InvalidArgument(f"{_q(text)} is not a size (e.g. 4096, 64KiB, 1MiB, 2GiB)")
        value = int(m[2]) * _UNITS[m[3].lower()]
        if m[1]:
            value = -value
    if value <= 0:
        raise InvalidArgument(f"size must be > 0, got {_q(text)}")
    if value > MAX_SIZE:
        raise InvalidArgument(f"size {_q(text)} is larger than 1 TiB")
    return value
