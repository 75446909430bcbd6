"""Layer 4: which NICs exist, which NUMA node each sits on, which CPUs to pin.

What lives here: turning ``fi_getinfo``'s answer into :class:`Nic` objects,
placing each NIC on a NUMA node from sysfs (or from an explicit override), and
grouping them into one :class:`Shard` per NUMA node together with that node's
CPUs. Everything past :func:`discover` is pure over a sysfs root, so tests run
against a fake tree in a temporary directory.

What must not live here: opening fabrics, domains or endpoints (the engine
does that per shard), pinning threads, or any policy about how transfers are
split across NICs. This module only describes the machine.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

from p2pxfer.errors import InvalidArgument, P2PXferError
from p2pxfer.fabric import FabricInfo, getinfo
from p2pxfer.log import get_logger

__all__ = [
    "Nic",
    "Shard",
    "Topology",
    "build_topology",
    "discover",
    "faster_providers",
    "is_loopback",
    "parse_cpulist",
    "select_nics",
]

log = get_logger("p2pxfer.topology")

# The kernel's NR_CPUS tops out at 8192; anything far above that in a cpulist
# is garbage, and refusing it keeps "0-4000000000" from building a huge tuple.
_MAX_CPU = 1 << 16

# One cpulist item: "N", "A-B" or the kernel's strided "A-B:USED/GROUP".
# [0-9] rather than \d: \d also matches non-ASCII digits, which int() accepts.
_CPULIST_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+)(?::([0-9]+)/([0-9]+))?)?")
_NUMA_VALUE = re.compile(r"-?[0-9]+")
_NODE_DIR = re.compile(r"node([0-9]+)")

# verbs and efa name RDM/datagram domains after the device plus a suffix
# ("rdmap0s6-rdm", "mlx5_0-dgram"); sysfs knows only the device.
_DOMAIN_SUFFIXES = ("-rdm", "-dgrm", "-dgram", "-xrc")

_ARPHRD_LOOPBACK = "772"  # /sys/class/net/<if>/type of a loopback interface
# Providers that copy through the kernel's sockets, and the RDMA ones that beat them.
_SOCKET_PROVIDERS = ("tcp", "sockets", "udp")
_RDMA_PROVIDERS = ("efa", "verbs")


@dataclass(frozen=True)
class Nic:
    """One interface (libfabric domain) of a provider.

    ``numa_node`` is -1 while unknown; every ``Nic`` in a :class:`Topology` has
    been placed on a node >= 0. ``info`` is the ``FabricInfo`` it came from
    (``None`` for NICs made up by tests); it takes no part in equality.
    """

    provider: str
    domain_name: str
    fabric_name: str
    numa_node: int = -1
    info: FabricInfo | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Shard:
    """The NICs of one NUMA node and the CPUs a poller for them may run on."""

    numa_node: int
    nics: tuple[Nic, ...]
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    """Every selected NIC, one shard per NUMA node that has NICs (ordered by node),
    and the usable CPUs of every node sysfs lists."""

    nics: tuple[Nic, ...]
    shards: tuple[Shard, ...]
    node_cpus: Mapping[int, tuple[int, ...]] = field(
        default_factory=lambda: MappingProxyType({}), hash=False
    )

    def cpus_of(self, node: int) -> tuple[int, ...]:
        """The CPUs of NUMA node ``node``; :class:`InvalidArgument` if it is unknown."""
        try:
            return self.node_cpus[node]
        except KeyError:
            raise InvalidArgument(
                f"no NUMA node {node!r} in this topology (known: {sorted(self.node_cpus)})"
            ) from None


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse Linux cpulist syntax ("0-3,8-11", "5", "0-15:2/4") into sorted CPU ids.

    Surrounding whitespace (the newline sysfs files end with) is ignored; an
    empty list (a memory-only NUMA node) gives ``()``. Anything else that is
    not a well-formed list raises :class:`InvalidArgument`.
    """
    if not isinstance(text, str):
        raise InvalidArgument(f"cpulist must be a str, not {type(text).__name__}")
    body = text.strip()
    if not body:
        return ()
    cpus: set[int] = set()
    for item in body.split(","):
        m = _CPULIST_ITEM.fullmatch(item)
        if m is None:
            raise InvalidArgument(
                f"bad cpulist {text!r}: {item!r} is not N, A-B or A-B:USED/GROUP"
            )
        first = int(m[1])
        last = int(m[2]) if m[2] is not None else first
        if last < first:
            raise InvalidArgument(f"bad cpulist {text!r}: range {item!r} runs backwards")
        if last > _MAX_CPU:
            raise InvalidArgument(f"bad cpulist {text!r}: cpu {last} is above {_MAX_CPU}")
        if m[3] is not None:
            used, group = int(m[3]), int(m[4])
            if used == 0 or group == 0 or used > group:
                raise InvalidArgument(
                    f"bad cpulist {text!r}: {item!r} needs 0 < USED <= GROUP"
                )
            # Same meaning as the kernel: the first USED of every GROUP cpus,
            # counted from the start of the range.
            cpus.update(c for c in range(first, last + 1) if (c - first) % group < used)
        else:
            cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def select_nics(nics: Iterable[Nic], interfaces: Sequence[str] | None = None) -> tuple[Nic, ...]:
    """One ``Nic`` per domain name (the first wins), optionally only ``interfaces``.

    tcp lists an interface once per address (IPv4, IPv6, link-local); all of them
    are the same NIC, and striping over them would only share one link. With
    ``interfaces`` the result follows that list's order; names that match no
    NIC, duplicates, or an empty list raise :class:`InvalidArgument`.
    """
    unique: dict[str, Nic] = {}
    for nic in nics:
        unique.setdefault(nic.domain_name, nic)
    if interfaces is None:
        return tuple(unique.values())
    # A bare string would be iterated letter by letter.
    if isinstance(interfaces, str):
        raise InvalidArgument(f"interfaces must be a list of names, not the string {interfaces!r}")
    names = list(interfaces)
    if not names:
        raise InvalidArgument("interfaces is empty: no NIC would be used")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidArgument(f"interfaces names {dupes} more than once")
    missing = [n for n in names if n not in unique]
    if missing:
        raise InvalidArgument(
            f"interfaces {missing} not found (available: {sorted(unique)})"
        )
    return tuple(unique[n] for n in names)


def build_topology(
    nics: Iterable[Nic],
    sysfs_root: str | os.PathLike[str] = "/sys",
    numa_override: Mapping[str, int] | None = None,
    *,
    allowed_cpus: Collection[int] | None = None,
) -> Topology:
    """Place ``nics`` on NUMA nodes and group them into shards. No libfabric calls.

    A NIC's node comes from ``numa_override[domain_name]`` if present (config
    beats sysfs), else from sysfs under ``sysfs_root``, else from the ``Nic``'s
    own ``numa_node``; unknown (-1) becomes node 0. Override names that match
    no NIC, or negative override nodes, raise :class:`InvalidArgument`.

    A node's CPUs are its sysfs ``cpulist``, kept to ``allowed_cpus`` when
    given (a poller cannot be pinned outside the process's affinity). Where
    that leaves nothing, or sysfs has no cpulist, every allowed CPU is used
    (``os.sched_getaffinity(0)`` when ``allowed_cpus`` is None).
    """
    root = Path(sysfs_root)
    nic_list = list(nics)
    override = _check_override(numa_override, nic_list)
    allowed = frozenset(allowed_cpus) if allowed_cpus is not None else None

    placed: list[Nic] = []
    for nic in nic_list:
        node, source = _place(nic, root, override)
        log.debug("topology.nic.placed", nic=nic.domain_name, provider=nic.provider,
                  numa_node=node, source=source)
        placed.append(replace(nic, numa_node=node))

    by_node: dict[int, list[Nic]] = {}
    for nic in placed:
        by_node.setdefault(nic.numa_node, []).append(nic)

    node_cpus: dict[int, tuple[int, ...]] = {}
    for node in sorted(set(_sysfs_nodes(root)) | set(by_node)):
        cpus, source = _node_cpus(root, node, allowed)
        if source != "sysfs" and node in by_node:
            log.warning("topology.cpus.fallback", numa_node=node, reason=source, cpus=cpus)
        node_cpus[node] = cpus

    shards = tuple(
        Shard(numa_node=node, nics=tuple(by_node[node]), cpus=node_cpus[node])
        for node in sorted(by_node)
    )
    return Topology(nics=tuple(placed), shards=shards, node_cpus=MappingProxyType(node_cpus))


def discover(
    provider: str,
    *,
    node: str | None = None,
    sysfs_root: str | os.PathLike[str] = "/sys",
    interfaces: Sequence[str] | None = None,
    numa_override: Mapping[str, int] | None = None,
    hmem: bool = False,
) -> Topology:
    """Ask libfabric for ``provider``'s interfaces and describe them as a :class:`Topology`.

    ``node`` is the local address to bind (see :func:`p2pxfer.fabric.getinfo`).
    ``interfaces`` and ``numa_override`` are the config's say: which NICs to use,
    in that order, and which NUMA node each is on where sysfs cannot tell (lo,
    veth) or is wrong. Shard CPUs are kept to this process's affinity.
    Raises ``ProviderNotFound`` when libfabric offers nothing, and
    :class:`InvalidArgument` for interfaces or overrides that match no NIC.
    """
    log.debug("topology.discover.started", provider=provider, node=node,
              interfaces=interfaces, sysfs_root=str(sysfs_root))
    try:
        infos = getinfo(provider, node=node, hmem=hmem)
        found = [
            Nic(provider=i.provider, domain_name=i.domain_name, fabric_name=i.fabric_name, info=i)
            for i in infos
        ]
        topo = build_topology(
            select_nics(found, interfaces),
            sysfs_root,
            numa_override,
            allowed_cpus=os.sched_getaffinity(0),
        )
    except Exception as exc:
        # The caller reports the error it gets; at WARNING this would say it twice.
        log.debug("topology.discover.failed", provider=provider, node=node, error=str(exc))
        raise
    log.info(
        "topology.discover.complete",
        provider=provider,
        nics=[n.domain_name for n in topo.nics],
        shards={s.numa_node: [n.domain_name for n in s.nics] for s in topo.shards},
    )
    return topo


def _check_override(override: Mapping[str, int] | None, nics: Sequence[Nic]) -> dict[str, int]:
    if override is None:
        return {}
    known = {n.domain_name for n in nics}
    # A typo in the config would otherwise silently leave a NIC on node 0.
    unknown = sorted(str(k) for k in override if k not in known)
    if unknown:
        raise InvalidArgument(
            f"numa_override names {unknown}, which match no NIC (available: {sorted(known)})"
        )
    out: dict[str, int] = {}
    for name, node in override.items():
        if isinstance(node, bool) or not isinstance(node, int) or node < 0:
            raise InvalidArgument(
                f"numa_override[{name!r}] must be a NUMA node number >= 0, not {node!r}"
            )
        out[name] = node
    return out


def _place(nic: Nic, root: Path, override: Mapping[str, int]) -> tuple[int, str]:
    """The NUMA node of ``nic`` and where that answer came from (for the log)."""
    if nic.domain_name in override:
        return override[nic.domain_name], "override"
    found = _sysfs_numa(nic.domain_name, root)
    if found is not None:
        value, path = found
        if value >= 0:
            return value, f"sysfs:{path}"
        # The kernel writes -1 when firmware did not say (single-node VMs).
        return 0, f"sysfs:{path} (unknown)"
    if nic.numa_node >= 0:
        return nic.numa_node, "given"
    return 0, "default (no device in sysfs)"


def _sysfs_numa(name: str, root: Path) -> tuple[int, Path] | None:
    """Read a NIC's ``numa_node`` from sysfs: netdevs first, then RDMA devices."""
    # Domain names come from providers and config; never let one walk the tree.
    if not name or "/" in name or name in (".", ".."):
        return None
    candidates = [name]
    candidates += [
        name[: -len(s)] for s in _DOMAIN_SUFFIXES if name.endswith(s) and len(name) > len(s)
    ]
    for cls in ("net", "infiniband"):
        for dev in candidates:
            found = _device_numa(root / "class" / cls / dev / "device", root / "devices")
            if found is not None:
                return found
    return None


def _device_numa(device: Path, devices_root: Path) -> tuple[int, Path] | None:
    value = _read_numa(device / "numa_node")
    if value is not None:
        return value, device / "numa_node"
    if not device.exists():
        return None
    # virtio NICs (most cloud VMs) have no numa_node of their own; the PCI
    # function they hang off does. Walk up, but never out of <root>/devices.
    top = devices_root.resolve()
    cur = device.resolve().parent
    while cur != top and cur.is_relative_to(top):
        value = _read_numa(cur / "numa_node")
        if value is not None:
            return value, cur / "numa_node"
        cur = cur.parent
    return None


def _read_numa(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    value = text.strip()
    if not _NUMA_VALUE.fullmatch(value):
        raise InvalidArgument(f"{path} holds {text!r}, not a NUMA node number")
    return int(value)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        # Placement is best effort: a sysfs file we may not read should not stop
        # the daemon, but it should be visible.
        log.warning("topology.sysfs.unreadable", path=str(path), error=str(exc))
        return None


def _sysfs_nodes(root: Path) -> list[int]:
    try:
        entries = list((root / "devices" / "system" / "node").iterdir())
    except OSError:
        return []
    nodes = []
    for entry in entries:
        m = _NODE_DIR.fullmatch(entry.name)
        if m is not None:
            nodes.append(int(m[1]))
    return nodes


def _node_cpus(
    root: Path, node: int, allowed: frozenset[int] | None
) -> tuple[tuple[int, ...], str]:
    """A node's usable CPUs, and "sysfs" or why they came from somewhere else."""
    path = root / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    text = _read_text(path)
    if text is None:
        cpus: tuple[int, ...] = ()
        source = f"no {path}"
    else:
        try:
            cpus = parse_cpulist(text)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{path}: {exc}") from None
        source = "sysfs" if cpus else f"{path} is empty"
    if allowed is not None and cpus:
        cpus = tuple(c for c in cpus if c in allowed)
        if not cpus:
            source = "no CPU of the node is in this process's affinity"
    if not cpus:
        cpus = tuple(sorted(allowed if allowed is not None else os.sched_getaffinity(0)))
    return cpus, source


def is_loopback(name: str, sysfs_root: str | os.PathLike[str] = "/sys") -> bool:
    """True when the interface ``name`` is a loopback device (``lo``, or any
    whose sysfs type says so): a rail on it never leaves this host."""
    if name == "lo":
        return True
    kind = _read_text(Path(sysfs_root) / "class" / "net" / name / "type")
    return kind is not None and kind.strip() == _ARPHRD_LOOPBACK


def faster_providers(provider: str) -> list[str]:
    """The RDMA providers (efa, verbs) libfabric offers here when ``provider``
    copies through sockets (tcp, sockets, udp); empty otherwise."""
    if provider.split(";", maxsplit=1)[0] not in _SOCKET_PROVIDERS:
        return []
    found = []
    for name in _RDMA_PROVIDERS:
        try:
            getinfo(name)  # the infos are freed when collected
        except P2PXferError:
            continue  # not on this machine
        found.append(name)
    return found
