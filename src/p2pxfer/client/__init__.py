"""Layer 8b: the client library (trio and asyncio through anyio, plus a
blocking facade). ``ConnectionLost`` is what a call raises when the
connection to the daemon is gone."""

from p2pxfer.errors import ConnectionLost as ConnectionLost

from ._client import Client as Client
from ._client import DaemonError as DaemonError
from ._client import MemberUpdate as MemberUpdate
from ._client import SharedMemory as SharedMemory
from ._client import connect as connect
from ._kv import KVPool as KVPool
from ._kv import KVPush as KVPush
from ._kv import KVPushResult as KVPushResult
from ._sync import SyncClient as SyncClient
