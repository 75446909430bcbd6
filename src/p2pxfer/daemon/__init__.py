"""Layer 8a: the node daemon (``p2pxfer daemon --config FILE``)."""

from ._config import DaemonConfig as DaemonConfig
from ._config import PeerAddress as PeerAddress
from ._daemon import Daemon as Daemon
from ._daemon import serve as serve
from ._dial import dial_peer as dial_peer
