"""Provider discovery: ``fi_getinfo`` with p2pxfer's hints, and ``FabricInfo``.

We ask for RDM endpoints with RMA write and remote CQ data, and tell the
provider which ``mr_mode`` bits we know how to honour (see ``SUPPORTED_MR_MODE``);
a provider that needs anything else (``FI_MR_RAW``, MMU notify) is not offered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pxfer.errors import ProviderNotFound

from ._binding import check, ffi, fi_strerror, lib

__all__ = ["DELIVERY_COMPLETE", "IMM_TAIL_ABOVE", "IMM_TAIL_BYTES", "SUPPORTED_MR_MODE",
           "FabricInfo", "MrMode", "getinfo", "providers_here"]

# FI_DELIVERY_COMPLETE (fabric.h; not among the binding's constants): a write
# completes at the initiator only once the target has placed it, so a write the
# target's provider refuses (stale key, out of range) fails at the initiator.
DELIVERY_COMPLETE = 1 << 28

# shm's tail of a piece sent apart with its immediate (``FabricInfo.imm_tail``;
# cut in C, ``P2P_IMM_TAIL_BYTES``), within its inline size (a 256-byte
# command less its header); only pieces over its inject size
# (``SMR_INJECT_SIZE``, 4 KiB) are cut, smaller ones complete at their post
# whole.
IMM_TAIL_BYTES = int(lib.P2P_IMM_TAIL_BYTES)
IMM_TAIL_ABOVE = 4096

# The mr_mode bits p2pxfer implements. FI_MR_HMEM is declared so providers that
# register device memory stay visible; host buffers are registered the same way.
SUPPORTED_MR_MODE = (
    lib.FI_MR_LOCAL
    | lib.FI_MR_VIRT_ADDR
    | lib.FI_MR_ALLOCATED
    | lib.FI_MR_PROV_KEY
    | lib.FI_MR_ENDPOINT
    | lib.FI_MR_HMEM
)


@dataclass(frozen=True)
class MrMode:
    """The registration rules a provider imposes, decoded from ``mr_mode``."""

    bits: int

    @property
    def virt_addr(self) -> bool:
        """Remote addresses are the target's virtual addresses (else offsets from 0)."""
        return bool(self.bits & lib.FI_MR_VIRT_ADDR)

    @property
    def prov_key(self) -> bool:
        """The provider picks keys; otherwise we request random ones."""
        return bool(self.bits & lib.FI_MR_PROV_KEY)

    @property
    def endpoint(self) -> bool:
        """Registrations must be bound to an endpoint and enabled."""
        return bool(self.bits & lib.FI_MR_ENDPOINT)

    @property
    def local(self) -> bool:
        """Local buffers need a registration and their descriptor on every post."""
        return bool(self.bits & lib.FI_MR_LOCAL)

    @property
    def allocated(self) -> bool:
        """Only memory backed by pages may be registered."""
        return bool(self.bits & lib.FI_MR_ALLOCATED)

    def names(self) -> list[str]:
        out = []
        for name in ("LOCAL", "VIRT_ADDR", "ALLOCATED", "PROV_KEY", "ENDPOINT", "HMEM"):
            if self.bits & getattr(lib, f"FI_MR_{name}"):
                out.append(name)
        return out


def _str(ptr: Any) -> str:
    return "" if ptr == ffi.NULL else str(ffi.string(ptr).decode(errors="replace"))


class FabricInfo:
    """One provider/interface as ``fi_getinfo`` described it.

    Owns a private copy of the ``fi_info`` (``fi_dupinfo``), freed by
    :meth:`close` or, as a backstop, when garbage collected.
    """

    def __init__(self, raw: Any) -> None:
        dup = lib.fi_dupinfo(raw)
        if dup == ffi.NULL:
            raise MemoryError("fi_dupinfo returned NULL")
        self._raw = ffi.gc(dup, lib.fi_freeinfo)

    @property
    def raw(self) -> Any:
        return self._raw

    def with_tx_op_flags(self, flags: int) -> FabricInfo:
        """A copy whose endpoints default to ``flags`` on every transmit (e.g.
        ``DELIVERY_COMPLETE``)."""
        out = FabricInfo(self._raw)
        out._raw.tx_attr.op_flags |= flags
        return out

    @property
    def tx_op_flags(self) -> int:
        return int(self._raw.tx_attr.op_flags)

    @property
    def provider(self) -> str:
        return _str(self._raw.fabric_attr.prov_name)

    @property
    def fabric_name(self) -> str:
        return _str(self._raw.fabric_attr.name)

    @property
    def domain_name(self) -> str:
        return _str(self._raw.domain_attr.name)

    @property
    def mr_mode(self) -> MrMode:
        return MrMode(int(self._raw.domain_attr.mr_mode))

    @property
    def hmem(self) -> bool:
        """The provider was asked for, and offers, device memory (FI_HMEM)."""
        return bool(int(self._raw.caps) & lib.FI_HMEM)

    @property
    def cq_data_size(self) -> int:
        return int(self._raw.domain_attr.cq_data_size)

    @property
    def mr_key_size(self) -> int:
        return int(self._raw.domain_attr.mr_key_size)

    @property
    def max_msg_size(self) -> int:
        return int(self._raw.ep_attr.max_msg_size)

    @property
    def ordered_writes(self) -> bool:
        """RMA writes on one connection are placed in the order posted, at
        any size (``max_order_waw_size``): tcp;ofi_rxm says so (SIZE_MAX),
        shm does not (0). Then a delivery-complete write also covers the
        writes posted before it to the same peer."""
        return int(self._raw.ep_attr.max_order_waw_size) >= self.max_msg_size

    @property
    def completions_order_writes(self) -> bool:
        """Once a write's completion is read, it has landed or sits ahead of
        every write posted to the same peer afterwards: true where writes are
        ordered (tcp), and for shm, which says ``max_order_waw_size`` 0 but
        completes a write either once its bytes are in the target (CMA, SAR)
        or once its command (inject) is in the peer's one FIFO command queue,
        which the target works through in order. So a delivery-complete
        write posted after reading every completion of earlier writes lands
        after them. (Measured why it matters: delivery-complete on every
        piece stalled shm at a few thousand small pieces in flight.)"""
        return self.ordered_writes or self.provider == "shm"

    @property
    def imm_tail(self) -> int:
        """Bytes of a piece to send apart, last, with its immediate (0: each
        piece whole). shm (libfabric 1.x) places a write that carries no
        immediate itself (CMA: ``smr_rma_fast``) before its post returns,
        where one carrying an immediate and over its inject size (4 KiB)
        waits, completion included, for the target's progress to copy it:
        a napping target's wake-up instead of a copy. A piece sent as all but
        its last ``IMM_TAIL_BYTES`` with no immediate (placed at its post),
        then those with it (inline: completes at its post, delivered behind
        the head in the peer's one FIFO command queue) waits for neither.
        Not where writes are delivery-complete (every protocol then waits
        for the target) or shm has no fast path (``FI_MR_VIRT_ADDR``);
        libfabric 2.x's shm was not measured."""
        if (self.provider != "shm" or self.tx_op_flags & DELIVERY_COMPLETE
                or not self.mr_mode.virt_addr or lib.FI_MAJOR_VERSION != 1):
            return 0
        return IMM_TAIL_BYTES

    @property
    def tx_size(self) -> int:
        return int(self._raw.tx_attr.size)

    @property
    def write_iovs(self) -> int:
        """Pieces one RMA write can carry: iovs on both sides
        (``iov_limit``, ``rma_iov_limit``; tcp;ofi_rxm and shm: 4)."""
        return max(1, min(int(self._raw.tx_attr.iov_limit),
                          int(self._raw.tx_attr.rma_iov_limit)))

    @property
    def manual_progress(self) -> bool:
        # tcp reports AUTO yet needs the CQ read for data to move: treat every
        # provider as manual and always progress; this flag is informational.
        return bool(int(self._raw.domain_attr.data_progress) == lib.FI_PROGRESS_MANUAL)

    def __repr__(self) -> str:
        return (
            f"FabricInfo(provider={self.provider!r}, domain={self.domain_name!r}, "
            f"fabric={self.fabric_name!r}, mr_mode={self.mr_mode.names()})"
        )


_VERSION = (lib.FI_MAJOR_VERSION << 16) | lib.FI_MINOR_VERSION


def _hints() -> Any:
    """What p2pxfer asks of a provider: RDM endpoints, RMA writes (with remote
    CQ data), the mr_modes it handles, thread-safe domains."""
    hints = ffi.gc(lib.fi_dupinfo(ffi.NULL), lib.fi_freeinfo)
    hints.caps = lib.FI_RMA | lib.FI_WRITE | lib.FI_REMOTE_WRITE
    hints.mode = 0
    hints.ep_attr.type = lib.FI_EP_RDM
    hints.domain_attr.mr_mode = SUPPORTED_MR_MODE
    hints.domain_attr.threading = lib.FI_THREAD_SAFE
    return hints


def getinfo(
    provider: str,
    *,
    node: str | None = None,
    service: str | None = None,
    domain: str | None = None,
    hmem: bool = False,
) -> list[FabricInfo]:
    """Every interface of ``provider`` that can do RDM RMA writes with remote CQ data.

    ``node``/``service`` name the local address to bind (``FI_SOURCE``), e.g.
    ``node="127.0.0.1"`` keeps tcp traffic on loopback. ``domain`` keeps only
    interfaces of that domain name (a NIC, e.g. ``"lo"`` or ``"veth0"``).
    Raises :class:`ProviderNotFound` when nothing matches. ``hmem``: ask for
    device-memory registration (``FI_HMEM``) too, and where the provider has
    none, take it without (``FabricInfo.hmem`` says which).
    """
    if hmem:
        try:
            return _getinfo(provider, node, service, domain, lib.FI_HMEM)
        except ProviderNotFound:
            pass
    return _getinfo(provider, node, service, domain, 0)


def _getinfo(provider: str, node: str | None, service: str | None, domain: str | None,
             caps: int) -> list[FabricInfo]:
    if not provider or not isinstance(provider, str):
        raise ProviderNotFound("fi_getinfo", -lib.FI_ENODATA,
                               f"{fi_strerror(lib.FI_ENODATA)}: no provider named", repr(provider))
    hints = _hints()
    hints.caps |= caps
    # fi_freeinfo frees prov_name/name, so they must come from malloc.
    hints.fabric_attr.prov_name = lib.strdup(provider.encode())
    if domain:
        hints.domain_attr.name = lib.strdup(domain.encode())
    out = ffi.new("struct fi_info **")
    c_node = node.encode() if node else ffi.NULL
    c_service = service.encode() if service else ffi.NULL
    flags = lib.FI_SOURCE if (node or service) else 0
    rc = lib.fi_getinfo(_VERSION, c_node, c_service, flags, hints, out)
    context = f"provider={provider!r} node={node!r} domain={domain!r}"
    if rc == -lib.FI_ENODATA:
        raise ProviderNotFound("fi_getinfo", int(rc),
                               f"{fi_strerror(rc)}: no matching provider or interface; "
                               f"{_what_is_here(provider)}", context)
    check(rc, "fi_getinfo", context)
    infos: list[FabricInfo] = []
    seen: set[tuple[str, str]] = set()
    try:
        cur = out[0]
        while cur != ffi.NULL:
            info = FabricInfo(cur)
            # Layered providers are matched by their full name ("tcp;ofi_rxm"),
            # and rxm lists each interface several times: keep its first entry.
            where = (info.fabric_name, info.domain_name)
            # Some providers (tcp) ignore the domain hint: filter here too.
            wanted = domain is None or info.domain_name == domain
            if (info.provider == provider and info.cq_data_size > 0 and wanted
                    and where not in seen):
                seen.add(where)
                infos.append(info)
            cur = cur.next
    finally:
        lib.fi_freeinfo(out[0])
    if not infos:
        raise ProviderNotFound(
            "fi_getinfo", -lib.FI_ENODATA,
            f"{fi_strerror(lib.FI_ENODATA)}: no interface with RMA write and CQ data; "
            f"{_what_is_here(provider)}", context
        )
    return infos


def providers_here() -> list[str]:
    """The providers of this machine's libfabric that offer RDM endpoints
    with RMA writes and remote CQ data (what p2pxfer can use), in
    ``fi_getinfo``'s order: the same question as :func:`getinfo` asks, with
    no provider, node or interface named."""
    hints = _hints()
    out = ffi.new("struct fi_info **")
    if lib.fi_getinfo(_VERSION, ffi.NULL, ffi.NULL, 0, hints, out) != 0:
        return []
    names: list[str] = []
    try:
        cur = out[0]
        while cur != ffi.NULL:
            name = _str(cur.fabric_attr.prov_name)
            if name and name not in names and int(cur.domain_attr.cq_data_size) > 0:
                names.append(name)
            cur = cur.next
    finally:
        lib.fi_freeinfo(out[0])
    return names


def _what_is_here(asked: str) -> str:
    """What to try instead of ``asked``: the providers this machine has."""
    here = providers_here()
    if not here:
        return ("this machine's libfabric offers no provider with RMA writes and CQ data "
                "(`fi_info -l` lists what it has)")
    usable = ", ".join(repr(p) for p in here)
    if asked in here:
        return (f"{asked!r} is here but not on that address or interface (check "
                f"fabric_node / --fabric-node and interfaces); providers here: {usable}")
    return f"providers on this machine: {usable} (`fi_info -l` lists every one)"
