"""The error tree: one base, ``P2PXferError``, and a few branches under it.

Every failure p2pxfer reports is one of these, so callers can catch the base.
Foreign errors (libfabric return codes, trio exception groups) are mapped here
or at the API edge, once; nothing below re-wraps an error that is already ours.

An error that can cross a socket (daemon -> client, daemon -> daemon) carries
its wire ``code`` (``proto/PROTOCOL.md``, "Error codes") as a class attribute;
the one code -> (class, fatal) table is ``p2pxfer.protocol.ERRORS``, built
from these classes. ``FabricError.code`` is libfabric's return code instead:
fabric errors never cross a socket as themselves (they are ``internal``).
"""

from __future__ import annotations


class P2PXferError(Exception):
    """Base of every error p2pxfer raises."""


class FabricError(P2PXferError):
    """A libfabric call failed: carries the call, its negative return code and
    ``fi_strerror``'s text (plus the provider's own words where it gave any)."""

    def __init__(self, call: str, code: int, text: str, context: str | None = None) -> None:
        self.call = call
        self.code = code
        self.text = text
        self.context = context
        where = f" ({context})" if context else ""
        super().__init__(f"{call} failed{where}: {text} [{code}]")


class ProviderNotFound(FabricError, LookupError):
    """No provider/interface matched what was asked for."""


class TransferError(P2PXferError):
    """A transfer failed after it was accepted (a completion came back with an
    error); the message carries the provider's words."""

    code: str = "transfer_failed"


class PeerUnreachable(TransferError):
    """The peer is gone (connection refused or reset) while a transfer ran,
    or its daemon could not be asked (``peer_unreachable``)."""

    code: str = "peer_unreachable"


#: the name callers have caught since the first release; the same class
RemoteClosed = PeerUnreachable


class RailsExhausted(PeerUnreachable):
    """Every rail pair to the peer failed under a write (errors, or no
    progress within ``EngineConfig.rail_stall_s`` while another pair still
    worked): its pieces could go nowhere. ``landed`` lists the piece ranges
    ``(start, end)`` known to be in the target's memory (delivery-complete
    acknowledged; only notify-mode writes know that)."""

    code: str = "rails_exhausted"

    def __init__(self, message: str, *, landed: tuple[tuple[int, int], ...] = ()) -> None:
        super().__init__(message)
        self.landed = landed


class RailFailedUnderImmediates(TransferError):
    """A rail pair failed under a write whose every piece carries the
    immediate (per-piece mode): pieces re-posted on another rail could land
    twice, so the receiver's count could not be exact, and the write fails
    instead of failing over (``completed`` pieces were acknowledged). Writes
    in notify mode (``notify=True``) fail over."""

    code: str = "immediates_inexact"

    def __init__(self, message: str, *, pieces: int = 0, completed: int = 0) -> None:
        super().__init__(message)
        self.pieces = pieces
        self.completed = completed


class NotificationUnknown(TransferError):
    """A notify-mode write's data landed (every piece acknowledged with
    delivery-complete), but its one notification failed or its rail went
    down before it was acknowledged: whether the receiver counted it is
    unknown. It is never sent twice, so the receiver's count is never
    doubled; the receiver may have to be told by other means."""

    code: str = "notification_unknown"


class PeerLost(PeerUnreachable):
    """Membership says the peer a transfer targets died, left or restarted
    (before or while it ran): its memory is gone, whatever the fabric says.
    Protocol error code ``peer_lost``."""

    code: str = "peer_lost"


class EngineClosed(P2PXferError):
    """The engine or rail was closed while the operation was pending."""

    code: str = "closed"


class ConnectionLost(P2PXferError):
    """The connection to a daemon ended (it closed, died, or could not be
    reached) before the answer came. Never sent on the wire: each side sees
    it for itself. Not an ``EngineClosed``: the engine behind that daemon
    may be running fine."""


class InvalidArgument(P2PXferError, ValueError):
    """Bad input from the caller; nothing was posted."""

    code: str = "bad_request"


class ScatterError(InvalidArgument):
    """A scatter list is malformed or does not fit the regions it names (or a
    byte range falls outside its memory)."""

    code: str = "out_of_range"


class RegistrationError(P2PXferError):
    """Memory cannot be registered or is not registered where it must be."""


class DeviceError(RegistrationError):
    """Device (GPU) memory could not be used: no CUDA driver, memory of
    another kind than claimed, or a CUDA driver call failed (its
    ``cuGetErrorString`` text is in the message). From the daemon: it cannot
    take device memory as is (``share_device``)."""

    code: str = "device"


class UnregisteredMemory(RegistrationError, InvalidArgument):
    """The buffer (or region) used was never registered with this rail (or a
    client names shared memory its connection does not hold)."""

    code: str = "unknown_mem"


class ReadOnlyBuffer(RegistrationError, InvalidArgument):
    """A read-only buffer was offered where a peer must be able to write."""


class DescriptorError(InvalidArgument):
    """A region descriptor is malformed, or does not match this provider."""


class WaitTimeout(P2PXferError, TimeoutError):
    """A bounded wait ran out before the awaited condition held."""


class DaemonError(P2PXferError):
    """The daemon refused a request for a reason of its own (``internal`` when
    nothing more specific applies). ``code`` is the protocol's error code; an
    instance made for a code this version does not know carries that code."""

    code: str = "internal"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class UnknownRegion(DaemonError, LookupError):
    """No region of that name is exported there (or not by this client)."""

    code = "unknown_region"


class RegionWithdrawn(UnknownRegion):
    """The region was there and its owner withdrew it saying why (``unexport``
    with a reason): it will not come back under that name for this use, so
    a writer waiting for it to appear can stop waiting."""

    code = "region_withdrawn"


class UnknownPeer(DaemonError, LookupError):
    """A request names a node that is neither this one nor a known peer."""

    code = "unknown_peer"


class NameTaken(DaemonError):
    """A region of that name is already exported on this node."""

    code = "name_taken"


class AuthenticationFailed(DaemonError):
    """Two daemons could not prove the cluster token to each other (a wrong
    token, a token on one side only, or another node at that address)."""

    code = "auth_failed"


class Forbidden(DaemonError, PermissionError):
    """The caller may not do this: a node-wide change (``add_peer``) asked by
    a uid that is neither root nor the daemon's own."""

    code = "forbidden"


class LimitExceeded(DaemonError):
    """A cap on what one client, uid or source may hold was reached
    (requests in flight, waiters, mapped bytes, exports, connections): the
    message names the cap and its value. Nothing was done; what the caller
    already holds is untouched, and comes back when it lets go."""

    code = "limit"


class ConfigError(InvalidArgument):
    """The daemon's configuration is wrong: the message names the key (and the
    file) and what it must be. Raised before anything is opened."""


class StartupError(P2PXferError):
    """The daemon could not start: ``what`` failed at ``where`` (a port, a
    path, a host), for ``reason``. The CLI prints it as one line."""

    def __init__(self, what: str, where: str, reason: str) -> None:
        self.what = what
        self.where = where
        self.reason = reason
        super().__init__(f"{what} {where}: {reason}")


class TransferAborted(TransferError):
    """A write was given up before every piece was acknowledged (its caller
    was cancelled and the posted pieces did not finish in time, or it was
    aborted): posting stopped and the connections carrying its pieces were
    torn down, so nothing of it stays posted. ``pieces`` were planned,
    ``completed`` were acknowledged by the provider before the end (known to
    have left, or with delivery-complete, landed); the other
    ``pieces - completed`` may or may not have landed. ``peer`` names the
    destination (node and region)."""

    code: str = "transfer_aborted"

    def __init__(self, message: str, *, peer: str = "", pieces: int = 0,
                 completed: int = 0) -> None:
        super().__init__(message)
        self.peer = peer
        self.pieces = pieces
        self.completed = completed

    @property
    def not_completed(self) -> int:
        return self.pieces - self.completed


class TransferTimeout(TransferAborted, TimeoutError):
    """A write's deadline (its ``timeout``, else ``EngineConfig.write_timeout_s``)
    passed before every piece was acknowledged; torn down as for
    ``TransferAborted``. This is how a silent peer (packets dropped, no reset)
    shows: the deadline is the detector."""

    code: str = "transfer_timeout"


class UsageError(P2PXferError, RuntimeError):
    """p2pxfer was called where it cannot work, e.g. a ``SyncClient`` made on a
    thread that runs an event loop (its blocking calls would hang that loop)."""
