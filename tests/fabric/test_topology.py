"""Topology: NIC placement and CPU lists against a fake sysfs tree, plus one real
discovery on loopback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from p2pxfer.errors import InvalidArgument
from p2pxfer.fabric import FabricInfo
from p2pxfer.topology import (
    Nic,
    Shard,
    Topology,
    build_topology,
    discover,
    parse_cpulist,
    select_nics,
)

TCP = "tcp;ofi_rxm"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _pci(root: Path, addr: str, numa: str | None) -> Path:
    dev = root / "devices" / "pci0000:00" / addr
    dev.mkdir(parents=True, exist_ok=True)
    if numa is not None:
        _write(dev / "numa_node", numa)
    return dev


def _link(root: Path, cls: str, name: str, device: Path | None) -> None:
    entry = root / "class" / cls / name
    entry.mkdir(parents=True, exist_ok=True)
    if device is not None:
        (entry / "device").symlink_to(device, target_is_directory=True)


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """Two NUMA nodes; eth0/eth1 on node 0, eth2/eth3 and mlx5_0 on node 1."""
    root = tmp_path / "sys"
    _write(root / "devices/system/node/node0/cpulist", "0-1\n")
    _write(root / "devices/system/node/node1/cpulist", "2-3\n")
    _link(root, "net", "eth0", _pci(root, "0000:00:01.0", "0\n"))
    _link(root, "net", "eth1", _pci(root, "0000:00:02.0", "0\n"))
    hca = _pci(root, "0000:81:00.0", "1\n")
    _link(root, "net", "eth2", hca)
    _link(root, "net", "eth3", _pci(root, "0000:82:00.0", "1\n"))
    _link(root, "infiniband", "mlx5_0", hca)
    _link(root, "infiniband", "rdmap0s6", _pci(root, "0000:83:00.0", "1\n"))
    # A virtio NIC: no numa_node of its own, its PCI parent has one.
    virtio = _pci(root, "0000:84:00.0", "1\n") / "virtio3"
    virtio.mkdir()
    _link(root, "net", "eth4", virtio)
    # Firmware that did not say where the device is.
    _link(root, "net", "eth5", _pci(root, "0000:85:00.0", "-1\n"))
    # Virtual interfaces: no device link at all.
    _link(root, "net", "lo", None)
    _link(root, "net", "veth0", None)
    return root


def nic(name: str, provider: str = TCP, numa_node: int = -1) -> Nic:
    return Nic(provider=provider, domain_name=name, fabric_name=f"{name}-fabric",
               numa_node=numa_node)


def names(nics: tuple[Nic, ...]) -> list[str]:
    return [n.domain_name for n in nics]


# -- parse_cpulist -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", (0,)),
        ("0-3", (0, 1, 2, 3)),
        ("0-3,8-11", (0, 1, 2, 3, 8, 9, 10, 11)),
        ("5,1,3", (1, 3, 5)),
        ("2-3,0\n", (0, 2, 3)),
        ("0-1,1-2", (0, 1, 2)),
        ("7-7", (7,)),
        ("0-15:2/4", (0, 1, 4, 5, 8, 9, 12, 13)),
        ("", ()),
        ("\n", ()),
    ],
)
def test_parse_cpulist(text: str, expected: tuple[int, ...]) -> None:
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize(
    "text",
    ["a", "1-", "-1", "3-1", "1,,2", "1,", ",1", "0 - 3", "1 2", "+1", "1_0", "0x1",
     "\u0661", "0-3:0/4", "0-3:4/2", "0-3:2", "0-99999999"],
)
def test_parse_cpulist_garbage(text: str) -> None:
    with pytest.raises(InvalidArgument, match="cpulist"):
        parse_cpulist(text)


def test_parse_cpulist_not_a_string() -> None:
    with pytest.raises(InvalidArgument):
        parse_cpulist(3)  # type: ignore[arg-type]


# -- build_topology over the fake sysfs ----------------------------------------


def test_two_shards(sysfs: Path) -> None:
    nics = [nic("eth0"), nic("eth2"), nic("eth1"), nic("eth3")]
    topo = build_topology(nics, sysfs)
    assert isinstance(topo, Topology)
    assert topo.shards == (
        Shard(numa_node=0, nics=(nic("eth0", numa_node=0), nic("eth1", numa_node=0)),
              cpus=(0, 1)),
        Shard(numa_node=1, nics=(nic("eth2", numa_node=1), nic("eth3", numa_node=1)),
              cpus=(2, 3)),
    )
    # nics keeps the caller's order; each is placed.
    assert names(topo.nics) == ["eth0", "eth2", "eth1", "eth3"]
    assert [n.numa_node for n in topo.nics] == [0, 1, 0, 1]
    assert topo.cpus_of(0) == (0, 1)
    assert topo.cpus_of(1) == (2, 3)


def test_infiniband_device(sysfs: Path) -> None:
    topo = build_topology([nic("mlx5_0", "verbs;ofi_rxm")], sysfs)
    assert [(s.numa_node, names(s.nics)) for s in topo.shards] == [(1, ["mlx5_0"])]
    assert topo.shards[0].cpus == (2, 3)


def test_efa_domain_suffix(sysfs: Path) -> None:
    topo = build_topology([nic("rdmap0s6-rdm", "efa")], sysfs)
    assert topo.nics[0].numa_node == 1


def test_virtio_parent(sysfs: Path) -> None:
    assert build_topology([nic("eth4")], sysfs).nics[0].numa_node == 1


def test_minus_one_is_node0(sysfs: Path) -> None:
    topo = build_topology([nic("eth5")], sysfs)
    assert topo.nics[0].numa_node == 0
    assert topo.shards[0].numa_node == 0


def test_missing_numa_file_is_node0(sysfs: Path) -> None:
    topo = build_topology([nic("lo"), nic("veth0"), nic("ghost9")], sysfs)
    assert [n.numa_node for n in topo.nics] == [0, 0, 0]
    assert len(topo.shards) == 1


def test_missing_numa_keeps_given_node(sysfs: Path) -> None:
    assert build_topology([nic("veth0", numa_node=1)], sysfs).nics[0].numa_node == 1


def test_numa_override(sysfs: Path) -> None:
    topo = build_topology([nic("lo"), nic("veth0"), nic("eth0")], sysfs,
                          {"veth0": 1, "eth0": 1})
    assert [(s.numa_node, names(s.nics)) for s in topo.shards] == [
        (0, ["lo"]),
        (1, ["veth0", "eth0"]),  # the override beats sysfs
    ]


@pytest.mark.parametrize("bad", [{"nope0": 0}, {"lo": -1}, {"lo": True}, {"lo": "1"}])
def test_numa_override_rejected(sysfs: Path, bad: dict[str, int]) -> None:
    with pytest.raises(InvalidArgument, match="numa_override"):
        build_topology([nic("lo")], sysfs, bad)


def test_garbage_numa_file(sysfs: Path) -> None:
    _write(sysfs / "devices/pci0000:00/0000:00:01.0/numa_node", "zero\n")
    with pytest.raises(InvalidArgument, match="numa_node"):
        build_topology([nic("eth0")], sysfs)


def test_garbage_cpulist_file(sysfs: Path) -> None:
    _write(sysfs / "devices/system/node/node1/cpulist", "2-\n")
    with pytest.raises(InvalidArgument, match="node1/cpulist"):
        build_topology([nic("eth2")], sysfs)


def test_missing_cpulist_uses_affinity(tmp_path: Path) -> None:
    # No node directories at all: every CPU this process may run on.
    topo = build_topology([nic("eth0", numa_node=2)], tmp_path)
    assert topo.shards[0].numa_node == 2
    assert topo.shards[0].cpus == tuple(sorted(os.sched_getaffinity(0)))


def test_allowed_cpus(sysfs: Path) -> None:
    topo = build_topology([nic("eth0"), nic("eth2")], sysfs, allowed_cpus={1, 2})
    assert [s.cpus for s in topo.shards] == [(1,), (2,)]
    # No CPU of node 1 allowed: its poller may run on any allowed CPU instead.
    topo = build_topology([nic("eth0"), nic("eth2")], sysfs, allowed_cpus={0, 1})
    assert [s.cpus for s in topo.shards] == [(0, 1), (0, 1)]


def test_cpus_of_nodes_without_nics(sysfs: Path) -> None:
    topo = build_topology([nic("eth0")], sysfs)
    assert [s.numa_node for s in topo.shards] == [0]
    assert topo.cpus_of(1) == (2, 3)
    with pytest.raises(InvalidArgument, match="NUMA node 7"):
        topo.cpus_of(7)


def test_no_nics(sysfs: Path) -> None:
    topo = build_topology([], sysfs)
    assert topo.nics == () and topo.shards == ()


# -- select_nics ---------------------------------------------------------------


def test_select_dedups_domains() -> None:
    v4 = Nic(TCP, "eth0", "192.0.2.0/24")
    v6 = Nic(TCP, "eth0", "fe80::/64")
    assert select_nics([v4, v6, nic("lo")]) == (v4, nic("lo"))


def test_select_interfaces_in_given_order() -> None:
    nics = [nic("eth0"), nic("eth1"), nic("eth2")]
    assert names(select_nics(nics, ["eth2", "eth0"])) == ["eth2", "eth0"]


@pytest.mark.parametrize(
    ("interfaces", "match"),
    [
        (["eth0", "nope0", "nope1"], r"\['nope0', 'nope1'\] not found"),
        (["eth0", "eth0"], "more than once"),
        ([], "empty"),
        ("eth0", "not the string"),
    ],
)
def test_select_interfaces_rejected(interfaces: list[str], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        select_nics([nic("eth0"), nic("eth1")], interfaces)


# -- discover against real libfabric and the real /sys -------------------------


def test_discover_loopback() -> None:
    topo = discover(TCP, node="127.0.0.1")
    assert "lo" in names(topo.nics)
    assert len(topo.shards) == 1
    (shard,) = topo.shards
    assert shard.numa_node >= 0
    assert shard.cpus and set(shard.cpus) <= os.sched_getaffinity(0)
    lo = next(n for n in topo.nics if n.domain_name == "lo")
    assert lo.provider == TCP
    assert isinstance(lo.info, FabricInfo)
    assert lo.info.domain_name == "lo"


def test_discover_one_nic_per_domain() -> None:
    # Without a bind address tcp lists lo (and every NIC) once per address.
    found = names(discover(TCP).nics)
    assert len(found) == len(set(found))


def test_discover_config_override(sysfs: Path) -> None:
    topo = discover(TCP, node="127.0.0.1", sysfs_root=sysfs, interfaces=["lo"],
                    numa_override={"lo": 1})
    assert [(s.numa_node, names(s.nics)) for s in topo.shards] == [(1, ["lo"])]
    assert set(topo.shards[0].cpus) <= os.sched_getaffinity(0)


def test_discover_unknown_interface() -> None:
    with pytest.raises(InvalidArgument, match="nope0"):
        discover(TCP, node="127.0.0.1", interfaces=["lo", "nope0"])
