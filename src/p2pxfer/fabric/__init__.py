"""Layer 2: thin Python objects over the libfabric binding.

This package is the only place that touches libfabric's binding
(``p2pxfer._fabric``); the loops over page lists that need no fabric live in
``p2pxfer.pages``. It opens
providers, registers memory, posts whole scatter lists through the C helper and
drains completions in batches; it holds no per-transfer bookkeeping.
"""

from ._batch import CURSOR_SHIFT as CURSOR_SHIFT
from ._batch import PEER_GONE as PEER_GONE
from ._batch import TID_MASK as TID_MASK
from ._batch import ExpressCursor as ExpressCursor
from ._batch import WriteBatch as WriteBatch
from ._batch import context_of as context_of
from ._batch import split_context as split_context
from ._binding import check as check
from ._binding import raw_address as raw_address
from ._info import DELIVERY_COMPLETE as DELIVERY_COMPLETE
from ._info import IMM_TAIL_ABOVE as IMM_TAIL_ABOVE
from ._info import SUPPORTED_MR_MODE as SUPPORTED_MR_MODE
from ._info import FabricInfo as FabricInfo
from ._info import MrMode as MrMode
from ._info import getinfo as getinfo
from ._objects import ACCESS_REMOTE_WRITE as ACCESS_REMOTE_WRITE
from ._objects import ACCESS_WRITE as ACCESS_WRITE
from ._objects import AddressVector as AddressVector
from ._objects import CompletionQueue as CompletionQueue
from ._objects import Domain as Domain
from ._objects import Endpoint as Endpoint
from ._objects import Fabric as Fabric
from ._objects import MemoryRegion as MemoryRegion
from ._objects import open_shm_segment as open_shm_segment
from ._objects import shm_peer_gone as shm_peer_gone
from ._objects import shm_segment as shm_segment
from ._poller import FLAG_REMOTE_CQ_DATA as FLAG_REMOTE_CQ_DATA
from ._poller import CompletionError as CompletionError
from ._poller import Completions as Completions
from ._poller import Poller as Poller
from ._rail import Rail as Rail
from ._rail import StallWatch as StallWatch
from ._sockets import parse_sockaddr as parse_sockaddr
