"""Layer 5: the async engine (shards per NUMA node, poller threads bridged into
trio), the one data path: nothing else posts writes or counts completions.
``BlockingEngine`` is a facade over it for synchronous callers."""

from ._blocking import BlockingEngine as BlockingEngine
from ._config import EngineConfig as EngineConfig
from ._config import EngineStats as EngineStats
from ._engine import Engine as Engine
from ._engine import Transfer as Transfer
from ._failover import NOTIFY_BYTES as NOTIFY_BYTES
from ._open import open_engine as open_engine
from ._open import open_engine_on as open_engine_on
from ._plan import RailGroup as RailGroup
from ._plan import plan_stripes as plan_stripes
from ._state import NicStats as NicStats
