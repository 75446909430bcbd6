"""An engine's KV cache allocated where the node daemon maps it: zero copy
from the first byte, with no tensor rebound afterwards.

Serving engines allocate the KV cache inside a context their connector may
supply (vLLM: ``KVConnectorBase_V1.get_mem_pool_context``). While
:class:`Placement` is entered, a host-memory ``torch.zeros`` or
``torch.empty`` of one of the sizes it is told (the KV cache's backing
allocation) is answered from shared memory the daemon registered
(``alloc``, a callable the caller supplies), as a tensor viewing that
memory, its pages touched as ``torch.zeros`` would (a cache sized to the
host's memory fails here, at start, not mid-serving); every other call,
device allocations among them, goes to torch unchanged. Memory the daemon
refuses (its limits, a lost connection) is left to torch too, unless the
placement is required. Views the engine then makes of the
allocation (per-layer views, kernel-block views) all see the shared
memory, unlike a tensor moved afterwards (``Tensor.set_``), whose other
views keep the old storage.

What must not live here: the pool layout over the placed memory (the
connector's worker, from the tensors it is given), or posting. torch is
imported only when a placement is entered (it is optional). Threads: the
thread that allocates (the engine's) enters and leaves; ``placed`` is read
after it left.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Collection
from types import TracebackType
from typing import Any

from p2pxfer.client import SharedMemory
from p2pxfer.errors import P2PXferError
from p2pxfer.log import get_logger

__all__ = ["Placement"]

log = get_logger("p2pxfer.placement")

#: without sizes, smaller allocations are left to torch: the KV cache is
#: one or a few large ones, and shared memory is a registration and a
#: mapping each
MIN_BYTES = 64 << 10
PAGE = 4096


class Placement:
    """A context manager that places large host allocations (see the
    module docstring). ``placed``: the shared memories it handed out, in
    order, each with the tensor made over it."""

    def __init__(self, alloc: Callable[[int], SharedMemory], *,
                 sizes: Collection[int] = (), min_bytes: int = MIN_BYTES,
                 required: bool = False) -> None:
        self._alloc = alloc
        #: the sizes to place (the engine's KV allocations); empty: any of
        #: ``min_bytes`` or more
        self._sizes = frozenset(sizes)
        self._min_bytes = min_bytes
        self._required = required
        self._mode: Any = None
        self.placed: list[tuple[SharedMemory, Any]] = []

    def __enter__(self) -> Placement:
        torch = importlib.import_module("torch")
        overrides = importlib.import_module("torch.overrides")
        placement = self

        class Mode(overrides.TorchFunctionMode):  # type: ignore[misc,name-defined]
            def __torch_function__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if func in (torch.zeros, torch.empty):
                    t = placement._place(torch, args, kwargs)
                    if t is not None:
                        return t
                return func(*args, **kwargs)

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(et, exc, tb)

    def _place(self, torch: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """The tensor ``torch.zeros/empty(*args, **kwargs)`` asks for, over
        shared memory; None where torch should make it (small, on a device,
        or with options shared memory cannot honour)."""
        if set(kwargs) - {"dtype", "device"}:
            return None  # out=, layout=, pin_memory=, requires_grad=, names=...
        size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) \
            else args
        if not all(isinstance(n, int) and n >= 0 for n in size):
            return None
        device = kwargs.get("device")
        device = torch.get_default_device() if device is None else torch.device(device)
        if device.type != "cpu":
            return None
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        es = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(size) * es
        if nbytes == 0 or (nbytes not in self._sizes if self._sizes else
                           nbytes < self._min_bytes):
            return None
        try:
            mem = self._alloc(nbytes)
        except (P2PXferError, OSError) as exc:
            if self._required:
                raise
            log.warning("placement.refused", nbytes=nbytes, error=str(exc))
            return None
        # Fresh shared memory reads as zeros; a write per page makes it
        # resident now, as torch.zeros' memset would.
        mem.array[:nbytes:PAGE] = 0
        t = torch.from_numpy(mem.array[:nbytes]).view(dtype).view(tuple(size))
        self.placed.append((mem, t))
        log.info("placement.placed", nbytes=nbytes, dtype=str(dtype), shape=list(size))
        return t
