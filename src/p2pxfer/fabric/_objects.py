"""Thin Python objects over libfabric handles: Fabric, Domain, CompletionQueue,
AddressVector, Endpoint, MemoryRegion.

Each owns exactly one ``fid`` and closes it explicitly (``close()`` or ``with``);
``ffi.gc`` finalizers are not used for fids because libfabric needs children
closed before parents, which only explicit closing can order. Nothing here
loops over pages: the data path lives in ``native/src/p2p.c``.
"""

from __future__ import annotations

import os
import secrets
import threading
from types import TracebackType
from typing import Any, Self

from p2pxfer.errors import (
    FabricError,
    P2PXferError,
    PeerUnreachable,
    RegistrationError,
    TransferError,
)
from p2pxfer.log import get_logger

from ._binding import check, ffi, lib, raise_fabric_error
from ._info import FabricInfo

__all__ = [
    "ACCESS_REMOTE_WRITE",
    "ACCESS_WRITE",
    "AddressVector",
    "CompletionQueue",
    "Domain",
    "Endpoint",
    "Fabric",
    "MemoryRegion",
]

log = get_logger("p2pxfer.fabric")

ACCESS_WRITE = int(lib.FI_WRITE)  # local source of writes
ACCESS_REMOTE_WRITE = int(lib.FI_REMOTE_WRITE)  # peers may write into it


class _Fid:
    """Shared close/context-manager behaviour of every libfabric object."""

    _what = "fid"

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise FabricError(f"{self._what}", -int(lib.FI_EINVAL), "already closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def fid(self) -> Any:
        return ffi.cast("struct fid *", self.handle)

    def close(self) -> None:
        """Close the handle; idempotent. Children must be closed first."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        check(lib.fi_close(ffi.cast("struct fid *", handle)), "fi_close", self._what)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Fabric(_Fid):
    _what = "fabric"

    def __init__(self, info: FabricInfo) -> None:
        out = ffi.new("struct fid_fabric **")
        check(lib.fi_fabric(info.raw.fabric_attr, out, ffi.NULL), "fi_fabric", repr(info))
        super().__init__(out[0])
        self.info = info


class Domain(_Fid):
    """One NIC (or provider domain). Hands out unguessable MR keys, unique here."""

    _what = "domain"

    def __init__(self, fabric: Fabric, info: FabricInfo) -> None:
        out = ffi.new("struct fid_domain **")
        check(lib.fi_domain(fabric.handle, info.raw, out, ffi.NULL), "fi_domain", repr(info))
        super().__init__(out[0])
        self.info = info
        self._keys: set[int] = set()

    def _new_key(self) -> int:
        # A key is the only thing between a peer and our memory on providers
        # without provider keys: random, never reused while registered.
        bits = min(64, 8 * max(1, self.info.mr_key_size))
        while True:
            key = secrets.randbits(bits)
            if key not in self._keys:
                return key

    def _release_key(self, key: int) -> None:
        self._keys.discard(key)


class CompletionQueue(_Fid):
    """A CQ in ``FI_CQ_FORMAT_DATA`` with an fd wait object where the provider
    has one (``wait_fd`` is then >= 0); shm has none, and the poller backs off."""

    _what = "cq"

    def __init__(self, domain: Domain, size: int = 0) -> None:
        attr = ffi.new("struct fi_cq_attr *")
        attr.size = size
        attr.format = lib.FI_CQ_FORMAT_DATA
        attr.wait_obj = lib.FI_WAIT_FD
        out = ffi.new("struct fid_cq **")
        rc = lib.fi_cq_open(domain.handle, attr, out, ffi.NULL)
        if rc < 0:
            # FI_WAIT_FD is refused by shm (-FI_ENOSYS); FI_WAIT_UNSPEC ignores
            # timeouts there, so take no wait object and back off instead.
            attr.wait_obj = lib.FI_WAIT_NONE
            check(lib.fi_cq_open(domain.handle, attr, out, ffi.NULL), "fi_cq_open")
        super().__init__(out[0])
        self.wait_fd = -1
        if attr.wait_obj == lib.FI_WAIT_FD:
            fd = ffi.new("int *")
            check(lib.fi_control(self.fid(), lib.FI_GETWAIT, fd), "fi_control(FI_GETWAIT)")
            self.wait_fd = int(fd[0])

    def read_error(self) -> tuple[int, int, int, str]:
        """Read one error entry: (context id, flags, -errno, provider words)."""
        err = ffi.new("struct fi_cq_err_entry *")
        rc = lib.fi_cq_readerr(self.handle, err, 0)
        if rc == -lib.FI_EAGAIN:
            return (0, 0, 0, "")
        check(rc, "fi_cq_readerr")
        code = -abs(int(err.err))
        words = ffi.new("char[256]")
        prov = lib.fi_cq_strerror(self.handle, err.prov_errno, err.err_data, words, 256)
        text = ffi.string(lib.fi_strerror(abs(code))).decode(errors="replace")
        if prov != ffi.NULL:
            ptext = ffi.string(prov).decode(errors="replace")
            if ptext and ptext != text:
                text = f"{text}: {ptext}"
        ctx = int(ffi.cast("uintptr_t", err.op_context))
        return (ctx, int(err.flags), code, text)


class AddressVector(_Fid):
    """Peer addresses -> ``fi_addr_t``; each address is inserted once."""

    _what = "av"

    def __init__(self, domain: Domain) -> None:
        attr = ffi.new("struct fi_av_attr *")
        av_type = domain.info.raw.domain_attr.av_type
        attr.type = av_type if av_type != lib.FI_AV_UNSPEC else lib.FI_AV_TABLE
        out = ffi.new("struct fid_av **")
        check(lib.fi_av_open(domain.handle, attr, out, ffi.NULL), "fi_av_open")
        super().__init__(out[0])
        self._by_addr: dict[bytes, int] = {}
        #: counts removals: a ``WriteBatch`` made before one re-inserts its peers
        self.epoch = 0
        self.is_shm = domain.info.provider == "shm"
        # Both the trio thread (a write's first lookup) and a shard's poller
        # thread (teardown, re-insertion) use the AV, and the libfabric calls
        # drop the GIL: a lookup-then-insert or a remove is one step under it.
        self._lock = threading.Lock()

    def insert(self, address: bytes) -> int:
        hit = self._by_addr.get(address)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._by_addr.get(address)  # inserted while we waited
            if hit is not None:
                return hit
            if self.is_shm:
                check_shm_peer(address)
            fi_addr = ffi.new("fi_addr_t *")
            n = lib.fi_av_insert(self.handle, address, 1, fi_addr, 0, ffi.NULL)
            if n != 1:
                raise_fabric_error("fi_av_insert", n if n < 0 else -int(lib.FI_EINVAL),
                                   address.hex())
            self._by_addr[address] = int(fi_addr[0])
            return int(fi_addr[0])

    def holds(self, address: bytes) -> bool:
        return address in self._by_addr

    def remove(self, address: bytes) -> None:
        with self._lock:
            fi_addr = self._by_addr.pop(address, None)
            if fi_addr is None:
                return
            self.epoch += 1
            arr = ffi.new("fi_addr_t[1]", [fi_addr])
            check(lib.fi_av_remove(self.handle, arr, 1, 0), "fi_av_remove")

    def straddr(self, address: bytes) -> str:
        buf = ffi.new("char[128]")
        n = ffi.new("size_t *", 128)
        s = lib.fi_av_straddr(self.handle, address, buf, n)
        # Some providers (mrail) return NULL here.
        return address.hex() if s == ffi.NULL else str(ffi.string(s).decode(errors="replace"))


#: peer address -> its segment's path (``check_shm_peer`` runs per write)
_SHM_PATHS: dict[bytes, str] = {}
_SHM_PATHS_MAX = 4096


def shm_segment(address: bytes) -> str:
    """Where the shm endpoint at ``address`` keeps its segment
    (/dev/shm/<name>; "" for a name that is no plain file name). Worked out
    once per peer."""
    path = _SHM_PATHS.get(address)
    if path is None:
        name = address.rstrip(b"\0").decode(errors="replace").removeprefix("fi_shm://")
        path = "" if "/" in name else f"/dev/shm/{name}"
        if len(_SHM_PATHS) >= _SHM_PATHS_MAX:
            _SHM_PATHS.clear()  # many peers came and went: start over
        _SHM_PATHS[address] = path
    return path


def check_shm_peer(address: bytes) -> None:
    """libfabric 1.17's shm segfaults in fi_av_insert when the peer's segment is
    gone; its segment lives at /dev/shm/<name>, so look before inserting. One
    ``stat`` per call."""
    path = shm_segment(address)
    if path:
        try:
            os.stat(path)
            return
        except OSError:
            pass
    raise shm_peer_gone(address)


def open_shm_segment(address: bytes) -> int:
    """An ``O_PATH`` descriptor of the shm peer's segment at ``address``
    (``shm_segment``), for ``ExpressCursor.post`` to look at on every write
    without walking its path; -1 for a name that is no plain file name. The
    caller closes it. A segment that is gone raises ``PeerUnreachable``."""
    path = shm_segment(address)
    if not path:
        return -1
    try:
        return os.open(path, os.O_PATH | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise shm_peer_gone(address) from None
    except OSError as exc:  # out of descriptors, say: the peer may be fine
        raise TransferError(f"cannot look at shm peer segment {path}: {exc}") from exc


def shm_peer_gone(address: bytes) -> PeerUnreachable:
    """The error for a shm peer at ``address`` whose segment is gone."""
    text = address.rstrip(b"\0").decode(errors="replace")
    return PeerUnreachable(f"shm peer {text!r} is gone: no /dev/shm/"
                           f"{text.removeprefix('fi_shm://')}")


class Endpoint(_Fid):
    """An RDM endpoint bound to one CQ (transmit and receive) and one AV."""

    _what = "endpoint"

    def __init__(
        self, domain: Domain, info: FabricInfo, cq: CompletionQueue, av: AddressVector
    ) -> None:
        out = ffi.new("struct fid_ep **")
        check(lib.fi_endpoint(domain.handle, info.raw, out, ffi.NULL), "fi_endpoint")
        super().__init__(out[0])
        try:
            check(lib.fi_ep_bind(self.handle, av.fid(), 0), "fi_ep_bind(av)")
            check(
                lib.fi_ep_bind(self.handle, cq.fid(), lib.FI_TRANSMIT | lib.FI_RECV),
                "fi_ep_bind(cq)",
            )
            check(lib.fi_enable(self.handle), "fi_enable")
        except BaseException:
            self.close()
            raise
        self.address = self._getname()

    def _getname(self) -> bytes:
        size = ffi.new("size_t *", 256)
        buf = ffi.new("char[]", 256)
        rc = lib.fi_getname(self.fid(), buf, size)
        if rc == -lib.FI_ETRUNC:
            buf = ffi.new("char[]", size[0])
            rc = lib.fi_getname(self.fid(), buf, size)
        check(rc, "fi_getname")
        return bytes(ffi.buffer(buf, size[0]))


class MemoryRegion(_Fid):
    """A registration of ``[address, address + length)`` on one domain.

    Applies the provider's ``mr_mode`` rules: random requested keys unless the
    provider picks them, bind + enable under ``FI_MR_ENDPOINT``, and a remote
    ``base`` that is the virtual address under ``FI_MR_VIRT_ADDR`` or 0 where
    remote addresses are offsets.
    """

    _what = "mr"

    def __init__(
        self,
        domain: Domain,
        address: int,
        length: int,
        access: int,
        endpoint: Endpoint | None = None,
        device: int = -1,
    ) -> None:
        mode = domain.info.mr_mode
        if length <= 0:
            raise RegistrationError(f"cannot register {length} bytes: length must be > 0")
        if device >= 0 and not domain.info.hmem:
            raise RegistrationError(
                f"{domain.info.provider} on {domain.info.domain_name} was not opened with "
                "device memory (FI_HMEM): CUDA memory cannot be registered directly "
                "(EngineConfig.hmem, where the provider has it; KV pools stage through host "
                "memory instead)")
        out = ffi.new("struct fid_mr **")
        for _attempt in range(8):
            requested = 0 if mode.prov_key else domain._new_key()
            if device < 0:
                rc = lib.fi_mr_reg(
                    domain.handle, ffi.cast("void *", address), length, access, 0, requested,
                    0, out, ffi.NULL,
                )
            else:
                rc = _register_device(domain, address, length, access, requested, device, out)
            if rc != -lib.FI_ENOKEY:
                break
        if device < 0:
            check(rc, "fi_mr_reg", f"{length} bytes at {address:#x}")
        else:
            check(rc, "fi_mr_regattr", f"{length} bytes of CUDA memory at {address:#x} on "
                                       f"device {device} ({domain.info.provider})")
        super().__init__(out[0])
        self._domain = domain
        try:
            if mode.endpoint:
                if endpoint is None:
                    raise RegistrationError("provider needs FI_MR_ENDPOINT: give an endpoint")
                check(lib.fi_mr_bind(self.handle, endpoint.fid(), 0), "fi_mr_bind")
                check(lib.fi_mr_enable(self.handle), "fi_mr_enable")
        except BaseException:
            super().close()
            raise
        self.address = address
        self.length = length
        self.access = access
        self.key = int(lib.fi_mr_key(self.handle))
        self.desc = lib.fi_mr_desc(self.handle)
        self.base = address if mode.virt_addr else 0
        domain._keys.add(self.key)

    def close(self) -> None:
        if self._handle is not None:
            self._domain._release_key(self.key)
        super().close()


def _register_device(domain: Domain, address: int, length: int, access: int, requested: int,
                     device: int, out: Any) -> int:
    """Register CUDA memory: as a dma-buf where this libfabric takes one (1.20
    on; the GPU driver exports the allocation), else by address with iface
    FI_HMEM_CUDA. The return code of the last attempt."""
    if lib.p2p_has_dmabuf():
        from p2pxfer.devmem import driver  # only here: device memory is optional

        try:
            fd, offset = driver().dmabuf(address, length, device)
        except P2PXferError as exc:
            log.debug("fabric.dmabuf_unavailable", error=str(exc))
        else:
            try:
                # The region starts at base_addr + offset: base_addr is the
                # allocation's start, which the dma-buf's offset 0 maps.
                rc = int(lib.p2p_mr_reg_dmabuf(domain.handle, fd, offset, length,
                                               address - offset, access, requested, device,
                                               out))
            finally:
                os.close(fd)
            if rc == 0:
                log.info("fabric.device_registered", via="dmabuf", nbytes=length)
            if rc in (0, -lib.FI_ENOKEY):
                return rc
            log.debug("fabric.dmabuf_refused", code=rc)
    rc = int(lib.p2p_mr_reg_hmem(domain.handle, address, length, access, requested,
                                 lib.FI_HMEM_CUDA, device, out))
    if rc == 0:
        log.info("fabric.device_registered", via="cuda", nbytes=length)
    return rc
