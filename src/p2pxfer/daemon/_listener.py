"""The unix socket clients connect to: claiming its path safely, accepting
(waiting out descriptor exhaustion), checking each caller's credentials and
the client cap, then running one ``ClientSession`` per client.

The path is never taken from a live daemon, nor from anything that is not a
socket, and removed on the way out only if it is still ours. What must not
live here: what a session serves (``_sessions``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import TYPE_CHECKING

import trio

from p2pxfer._pump import bounded
from p2pxfer.errors import DaemonError, InvalidArgument
from p2pxfer.log import get_logger
from p2pxfer.protocol import encode_frame

from ._io import peer_credentials
from ._sessions import ClientSession

if TYPE_CHECKING:
    from ._daemon import Daemon

__all__ = ["remove_socket", "serve_clients"]

log = get_logger("p2pxfer.daemon")


async def _claim_path(path: str) -> None:
    """Make room for our socket at ``path``: nothing there, or a stale socket
    (removed). A daemon that answers there is live: ``DaemonError``, we do
    not take its socket away. Anything that is not a socket is never
    removed: ``InvalidArgument``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise InvalidArgument(f"socket path {path} exists and is not a socket; refusing to "
                              "remove it (choose another path, or remove it yourself)")
    probe = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    live = True  # a listener too busy to answer in time is alive too
    try:
        with trio.move_on_after(2.0):
            await probe.connect(path)
    except OSError:
        live = False  # nobody listens: a stale socket from an earlier run
    finally:
        probe.close()
    if live:
        raise DaemonError(f"a daemon is already listening on {path}; refusing to take its "
                          "socket (stop it first, or choose another path)")
    os.unlink(path)


async def serve_clients(d: Daemon, nursery: trio.Nursery) -> trio.socket.SocketType:
    """Listen on the unix socket, created 0600 (0666 with ``allowed_uids``:
    those uids must be able to connect; ``SO_PEERCRED`` still refuses every
    other); returns the listening socket. ``DaemonError`` / ``InvalidArgument``
    when the path holds a live daemon's socket or something else."""
    path = d.config.socket
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    await _claim_path(path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is created 0600, never briefly wider
    try:
        await sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o666 if d.config.allowed_uids else 0o600)
    st = os.lstat(path)
    d.socket_identity = (st.st_dev, st.st_ino)
    sock.listen(64)
    nursery.start_soon(_accept, d, sock)
    return sock


def remove_socket(path: str, identity: tuple[int, int] | None) -> None:
    """Remove our socket file, only if it still is ours (a daemon started
    after us on the same path must keep its own)."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if identity is not None and (st.st_dev, st.st_ino) == identity:
            os.unlink(path)


# accept() failures that say "not now" (out of descriptors or memory): wait a
# little and go on, as trio.serve_listeners does for the control port.
_ACCEPT_LATER = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_BACKOFF_S = 0.1


async def _accept(d: Daemon, sock: trio.socket.SocketType) -> None:
    async with trio.open_nursery() as nursery:
        while True:
            try:
                conn, _ = await sock.accept()
            except OSError as exc:
                if exc.errno in _ACCEPT_LATER:
                    log.error("client.accept_failed", error=str(exc))
                    await trio.sleep(ACCEPT_BACKOFF_S)
                elif exc.errno != errno.ECONNABORTED:
                    raise
                continue
            nursery.start_soon(_client, d, conn)


async def _client(d: Daemon, sock: trio.socket.SocketType) -> None:
    try:
        pid, uid, _gid = peer_credentials(sock)
    except OSError as exc:
        log.warning("client.refused", error=bounded(str(exc)))
        sock.close()
        return
    allowed = {0, os.getuid(), *d.config.allowed_uids}
    if uid not in allowed:
        log.warning("client.refused", pid=pid, uid=uid)
        sock.close()
        return
    if (reason := d.limits.admit(uid, len(d.sessions))) is not None:
        refused = d.limits.refuse(None, "max_clients", reason, uid=uid)
        # Said before the client's hello is read: its connection ends on
        # ``limit`` naming the cap, not on a bare hang-up.
        # (The socket is non-blocking: a client that reads nothing loses it.)
        with contextlib.suppress(OSError):
            os.write(sock.fileno(), encode_frame({"t": "error", "id": None,
                                                  "code": refused.code,
                                                  "message": str(refused)}))
        sock.close()
        return
    session = ClientSession(d, sock, pid, uid)
    d.sessions.add(session)
    d.limits.joined(session)
    try:
        await session.run()
    except Exception as exc:  # one client's failure must never reach the others
        log.error("client.failed", client=session.label,
                  error=bounded(f"{type(exc).__name__}: {exc}"))
    finally:
        d.sessions.discard(session)
        d.limits.left(session)
