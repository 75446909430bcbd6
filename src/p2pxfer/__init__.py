"""p2pxfer: asynchronous point-to-point RDMA writes of scatter lists over libfabric.

This module only re-exports the public API; see ``docs/architecture.md`` for
the layers behind it. The engine's names (and the memory registration behind
them) load libfabric, so they are imported when first used: a program that
only talks to a daemon (``p2pxfer.connect``, ``SyncClient``) never loads the
fabric, its providers or the signal handlers they bring.
"""

import importlib
from typing import TYPE_CHECKING, Any

from p2pxfer.buffers import RegionDescriptor as RegionDescriptor
from p2pxfer.buffers import SharedBuffer as SharedBuffer
from p2pxfer.buffers import alloc_shared as alloc_shared
from p2pxfer.client import Client as Client
from p2pxfer.client import DaemonError as DaemonError
from p2pxfer.client import MemberUpdate as MemberUpdate
from p2pxfer.client import SharedMemory as SharedMemory
from p2pxfer.client import SyncClient as SyncClient
from p2pxfer.client import connect as connect
from p2pxfer.errors import ConnectionLost as ConnectionLost
from p2pxfer.errors import DescriptorError as DescriptorError
from p2pxfer.errors import EngineClosed as EngineClosed
from p2pxfer.errors import FabricError as FabricError
from p2pxfer.errors import InvalidArgument as InvalidArgument
from p2pxfer.errors import NotificationUnknown as NotificationUnknown
from p2pxfer.errors import P2PXferError as P2PXferError
from p2pxfer.errors import PeerLost as PeerLost
from p2pxfer.errors import PeerUnreachable as PeerUnreachable
from p2pxfer.errors import ProviderNotFound as ProviderNotFound
from p2pxfer.errors import RailsExhausted as RailsExhausted
from p2pxfer.errors import ReadOnlyBuffer as ReadOnlyBuffer
from p2pxfer.errors import RegionWithdrawn as RegionWithdrawn
from p2pxfer.errors import RegistrationError as RegistrationError
from p2pxfer.errors import RemoteClosed as RemoteClosed
from p2pxfer.errors import ScatterError as ScatterError
from p2pxfer.errors import TransferAborted as TransferAborted
from p2pxfer.errors import TransferError as TransferError
from p2pxfer.errors import TransferTimeout as TransferTimeout
from p2pxfer.errors import UnregisteredMemory as UnregisteredMemory
from p2pxfer.errors import WaitTimeout as WaitTimeout
from p2pxfer.scatter import ScatterList as ScatterList

if TYPE_CHECKING:
    from p2pxfer.engine import BlockingEngine as BlockingEngine
    from p2pxfer.engine import Engine as Engine
    from p2pxfer.engine import EngineConfig as EngineConfig
    from p2pxfer.engine import open_engine as open_engine
    from p2pxfer.memory import LocalRegion as LocalRegion
    from p2pxfer.memory import RegistrationCache as RegistrationCache

_LAZY = {"BlockingEngine": "p2pxfer.engine", "Engine": "p2pxfer.engine",
         "EngineConfig": "p2pxfer.engine", "open_engine": "p2pxfer.engine",
         "LocalRegion": "p2pxfer.memory", "RegistrationCache": "p2pxfer.memory"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'p2pxfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"

__all__ = [
    "BlockingEngine",
    "Client",
    "ConnectionLost",
    "DaemonError",
    "DescriptorError",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "FabricError",
    "InvalidArgument",
    "LocalRegion",
    "MemberUpdate",
    "NotificationUnknown",
    "P2PXferError",
    "PeerLost",
    "PeerUnreachable",
    "ProviderNotFound",
    "RailsExhausted",
    "ReadOnlyBuffer",
    "RegionDescriptor",
    "RegionWithdrawn",
    "RegistrationCache",
    "RegistrationError",
    "RemoteClosed",
    "ScatterError",
    "ScatterList",
    "SharedBuffer",
    "SharedMemory",
    "SyncClient",
    "TransferAborted",
    "TransferError",
    "TransferTimeout",
    "UnregisteredMemory",
    "WaitTimeout",
    "alloc_shared",
    "connect",
    "open_engine",
]
