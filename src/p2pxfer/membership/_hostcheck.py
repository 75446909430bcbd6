"""Is a member's process still there? One TCP connection to its address.

Both backends ask before a verdict that would end a life: a member that
answered nothing for a while (SWIM's suspicion ran out; etcd deleted its
key because its lease lapsed) may only be starved of the CPU on a busy
host. Its kernel still accepts on the port the daemon listens on (the
control port shares the membership address), so a connection that is
accepted means "there, not scheduled"; a refusal means the process is gone;
no answer means the host itself is cut off or down.
What must not live here: the rules of what follows a verdict (the backends).
Runs in the trio thread of the backend that calls it.
"""

from __future__ import annotations

import socket
from typing import Literal

import trio

from ._backend import MembershipError

__all__ = ["Verdict", "check_host", "join_hostport", "split_hostport"]

Verdict = Literal["answered", "refused", "silent"]


def split_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise MembershipError(f"{text!r} is not host:port")
    return host.strip("[]"), int(port)


def join_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def check_host(address: str, within: float) -> tuple[Verdict, str]:
    """Connect to ``address`` (``host:port``) and close at once: the verdict,
    and what made it (for the log). Never raises: an address in the wrong
    shape (a member's word, checked for shape only) or a socket refused us
    (descriptors run out) is no answer."""
    s: trio.socket.SocketType | None = None
    try:
        host, port = split_hostport(address)
        s = trio.socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                               socket.SOCK_STREAM)
        with trio.move_on_after(within):
            await s.connect((host, port))
            return "answered", "accepted"
        return "silent", f"no answer within {within:.2f} s"
    except ConnectionRefusedError:
        return "refused", "connection refused"
    except (OSError, MembershipError) as exc:  # unreachable and such: no answer
        return "silent", str(exc)
    finally:
        if s is not None:
            s.close()
