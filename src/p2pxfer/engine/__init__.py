"""Layer 5: the async engine (shards per NUMA node, poller threads bridged into trio)."""

from ._engine import Engine as Engine
from ._engine import EngineConfig as EngineConfig
from ._engine import EngineStats as EngineStats
from ._engine import NicStats as NicStats
from ._engine import Transfer as Transfer
from ._engine import open_engine as open_engine
