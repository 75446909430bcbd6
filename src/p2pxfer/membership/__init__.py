"""Layer 7: who is in the cluster now.

A sans-IO SWIM protocol (``Swim``) with authenticated datagrams, and two
backends behind one interface (``MembershipBackend``): ``EmbeddedBackend``
runs SWIM over UDP, ``EtcdBackend`` keeps members as keys under a lease in
etcd. Both speak the same events (``MemberJoined``, ``MemberDead``, ...) and
answer ``is_current(name, incarnation)``, which the daemon asks before it
trusts a descriptor. The wire format is in ``proto/MEMBERSHIP.md``.
"""

from ._backend import MembershipBackend as MembershipBackend
from ._backend import MembershipError as MembershipError
from ._backend import PeerLost as PeerLost
from ._backend import StaleIncarnation as StaleIncarnation
from ._embedded import EmbeddedBackend as EmbeddedBackend
from ._etcd import EtcdBackend as EtcdBackend
from ._member import AuthFailed as AuthFailed
from ._member import BadDatagram as BadDatagram
from ._member import Member as Member
from ._member import MemberAlive as MemberAlive
from ._member import MemberDead as MemberDead
from ._member import MemberDegraded as MemberDegraded
from ._member import MemberJoined as MemberJoined
from ._member import MemberLeft as MemberLeft
from ._member import MemberRestarted as MemberRestarted
from ._member import MembershipEvent as MembershipEvent
from ._member import MemberState as MemberState
from ._member import MemberSuspect as MemberSuspect
from ._member import Superseded as Superseded
from ._member import new_incarnation as new_incarnation
from ._swim import Outgoing as Outgoing
from ._swim import Swim as Swim
from ._swim import SwimConfig as SwimConfig
from ._swim import SwimStatistics as SwimStatistics
from ._wire import ClusterAuth as ClusterAuth
