"""Device memory for the GPU tests, of each kind ``p2pxfer.devmem`` accepts:
torch CUDA tensors, ``__cuda_array_interface__`` objects (allocated with the
CUDA driver itself, so they need neither torch nor CuPy) and DLPack
producers. Each kind reads and writes its bytes through the host for the
tests' checks."""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import pytest

from p2pxfer.devmem import driver
from p2pxfer.errors import DeviceError
from p2pxfer.testing import DriverArray

U8 = npt.NDArray[np.uint8]


class DeviceArray(Protocol):
    obj: Any  # what a pool is given

    def read(self) -> U8: ...

    def write(self, data: U8) -> None: ...


class TorchArray:
    def __init__(self, nbytes: int, dlpack: bool = False) -> None:
        self.torch = importlib.import_module("torch")
        self.tensor = self.torch.zeros(nbytes, dtype=self.torch.uint8, device="cuda")
        self.obj = _DLPackOnly(self.tensor) if dlpack else self.tensor

    def read(self) -> U8:
        self.torch.cuda.synchronize()
        return np.asarray(self.tensor.cpu().numpy(), np.uint8)

    def write(self, data: U8) -> None:
        self.tensor.copy_(self.torch.from_numpy(np.ascontiguousarray(data, np.uint8)))
        self.torch.cuda.synchronize()

    def close(self) -> None:
        del self.tensor


class _DLPackOnly:
    """Only the DLPack protocol of a tensor (what JAX or others hand over)."""

    def __init__(self, tensor: Any) -> None:
        self._t = tensor

    def __dlpack__(self, **kw: Any) -> Any:
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self) -> Any:
        return self._t.__dlpack_device__()


KINDS = ("driver", "torch", "dlpack")


def cuda_or_skip() -> None:
    try:
        driver().use(0)
    except DeviceError as exc:
        pytest.skip(f"no CUDA device here: {exc}")


def make(kind: str, nbytes: int) -> Any:
    """A device array of ``kind`` (skips when that kind is not at hand)."""
    cuda_or_skip()
    if kind == "driver":
        return DriverArray(nbytes)
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return TorchArray(nbytes, dlpack=kind == "dlpack")
