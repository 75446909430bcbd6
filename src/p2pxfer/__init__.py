"""p2pxfer: asynchronous point-to-point RDMA writes of scatter lists over libfabric.

This module only re-exports the public API; see ``docs/architecture.md`` for
the layers behind it.
"""

from p2pxfer.log import ensure_default as _ensure_default

_ensure_default()

from p2pxfer.client import Client as Client  # noqa: E402
from p2pxfer.client import DaemonError as DaemonError  # noqa: E402
from p2pxfer.client import MemberUpdate as MemberUpdate  # noqa: E402
from p2pxfer.client import SharedMemory as SharedMemory  # noqa: E402
from p2pxfer.client import SyncClient as SyncClient  # noqa: E402
from p2pxfer.client import connect as connect  # noqa: E402
from p2pxfer.engine import BlockingEngine as BlockingEngine  # noqa: E402
from p2pxfer.engine import Engine as Engine  # noqa: E402
from p2pxfer.engine import EngineConfig as EngineConfig  # noqa: E402
from p2pxfer.engine import open_engine as open_engine  # noqa: E402
from p2pxfer.errors import ConnectionLost as ConnectionLost  # noqa: E402
from p2pxfer.errors import DescriptorError as DescriptorError  # noqa: E402
from p2pxfer.errors import EngineClosed as EngineClosed  # noqa: E402
from p2pxfer.errors import FabricError as FabricError  # noqa: E402
from p2pxfer.errors import InvalidArgument as InvalidArgument  # noqa: E402
from p2pxfer.errors import NotificationUnknown as NotificationUnknown  # noqa: E402
from p2pxfer.errors import P2PXferError as P2PXferError  # noqa: E402
from p2pxfer.errors import PeerLost as PeerLost  # noqa: E402
from p2pxfer.errors import PeerUnreachable as PeerUnreachable  # noqa: E402
from p2pxfer.errors import ProviderNotFound as ProviderNotFound  # noqa: E402
from p2pxfer.errors import RailsExhausted as RailsExhausted  # noqa: E402
from p2pxfer.errors import ReadOnlyBuffer as ReadOnlyBuffer  # noqa: E402
from p2pxfer.errors import RegistrationError as RegistrationError  # noqa: E402
from p2pxfer.errors import RemoteClosed as RemoteClosed  # noqa: E402
from p2pxfer.errors import ScatterError as ScatterError  # noqa: E402
from p2pxfer.errors import TransferAborted as TransferAborted  # noqa: E402
from p2pxfer.errors import TransferError as TransferError  # noqa: E402
from p2pxfer.errors import TransferTimeout as TransferTimeout  # noqa: E402
from p2pxfer.errors import UnregisteredMemory as UnregisteredMemory  # noqa: E402
from p2pxfer.errors import WaitTimeout as WaitTimeout  # noqa: E402
from p2pxfer.memory import LocalRegion as LocalRegion  # noqa: E402
from p2pxfer.memory import RegionDescriptor as RegionDescriptor  # noqa: E402
from p2pxfer.memory import RegistrationCache as RegistrationCache  # noqa: E402
from p2pxfer.memory import SharedBuffer as SharedBuffer  # noqa: E402
from p2pxfer.memory import alloc_shared as alloc_shared  # noqa: E402
from p2pxfer.scatter import ScatterList as ScatterList  # noqa: E402

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
