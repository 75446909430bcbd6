"""Bad input becomes one clear ``P2PXferError`` subclass, and nothing is posted.

A single engine per provider (``BlockingEngine``, one rail here) writes into a
region it exported itself (its one CQ sees both the write completions and the
arriving immediates), so every check runs against real registrations and real
descriptors. After each refused call, by the engine's statistics: no piece was
posted, no completion was seen, and after a moment of progress (the engine's
poller runs all along) the destination is still all zeros.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import re
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from conftest import posted, posted_bytes, run_child
from p2pxfer.buffers import DESCRIPTOR_VERSION, RegionDescriptor
from p2pxfer.engine import BlockingEngine
from p2pxfer.errors import (
    DescriptorError,
    FabricError,
    InvalidArgument,
    P2PXferError,
    PeerLost,
    ProviderNotFound,
    RailsExhausted,
    ReadOnlyBuffer,
    ScatterError,
    TransferError,
    UnregisteredMemory,
)
from p2pxfer.fabric import Poller, Rail, getinfo
from p2pxfer.fabric._binding import check, fi_strerror, lib
from p2pxfer.memory import RegistrationCache
from p2pxfer.scatter import ScatterList

SRC = 1 << 16
DST = 1 << 16
IMM = 7


def seen(engine: BlockingEngine) -> int:
    """Completions the engine has read: its writes', peers' arrivals, errors."""
    return sum(n.completed + n.received + n.errors for n in engine.statistics().nics)


@dataclass
class Setup:
    t: BlockingEngine
    src: np.ndarray
    dst: np.ndarray
    desc: RegionDescriptor
    entries: int

    def write(self, scatter: Any, **kw: Any) -> int:
        kw.setdefault("imm", IMM)
        kw.setdefault("timeout", 10)
        return self.t.write(kw.pop("source", self.src), kw.pop("to", self.desc), scatter, **kw)

    def assert_nothing_posted(self) -> None:
        assert posted(self.t) == 0
        assert posted_bytes(self.t) == 0
        assert seen(self.t) == self.entries
        time.sleep(0.005)  # the poller keeps reading the CQ meanwhile
        assert seen(self.t) == self.entries
        assert self.t.imm_count(IMM) == 0
        assert not self.dst.any(), "bytes landed in the destination"


@pytest.fixture
def s(engine: BlockingEngine) -> Iterator[Setup]:
    src = np.arange(SRC, dtype=np.uint64).astype(np.uint8)
    dst = np.zeros(DST, np.uint8)
    desc = engine.export(dst, "dst")
    engine.register(src)
    setup = Setup(engine, src, dst, desc, seen(engine))
    yield setup
    setup.assert_nothing_posted()


def pieces(src: list[int], dst: list[int], length: list[int]) -> ScatterList:
    return ScatterList(np.array(src, np.int64), np.array(dst, np.int64),
                       np.array(length, np.int64))


# -- the positive control: an engine writes into its own export ----------------

def test_write_to_own_export_lands(engine: BlockingEngine) -> None:
    src = np.random.default_rng(1).integers(0, 256, SRC, dtype=np.uint8)
    dst = np.zeros(DST, np.uint8)
    desc = engine.export(dst, "self")
    engine.register(src)
    sl = pieces([0, 100, SRC - 1], [DST - 500, 0, 5000], [500, 4000, 1])
    n = engine.write(src, desc, sl, imm=99, timeout=10)
    assert n == 3
    engine.wait_imm(99, n, timeout=10)
    assert engine.imm_count(99) == 0
    expected = np.zeros(DST, np.uint8)
    expected[DST - 500:] = src[:500]
    expected[:4000] = src[100:4100]
    expected[5000] = src[SRC - 1]
    assert np.array_equal(dst, expected)
    assert posted(engine) == 3 and posted_bytes(engine) == 4501


# -- scatter lists ------------------------------------------------------------------
# Messages are checked for the facts they must name (which piece, which side, the
# offending value, what is wrong), not for their exact wording.

def assert_names(err: BaseException, patterns: list[str]) -> None:
    msg = str(err)
    for pat in patterns:
        assert re.search(pat, msg), f"{pat!r} not in {msg!r}"


@pytest.mark.parametrize(
    ("src", "dst", "length", "patterns"),
    [
        ([SRC], [0], [1], [r"piece 0\b", "source offset 65536", r"length 1\b",
                           "ends past the source region", "65536 bytes"]),
        ([SRC + 10_000], [0], [1], ["source offset 75536", "ends past the source region"]),
        ([0], [DST], [1], [r"piece 0\b", "destination offset 65536",
                           "ends past the destination region"]),
        ([0, 0], [0, 2 * DST], [1, 1], [r"piece 1\b", "destination offset 131072",
                                        "ends past the destination region"]),
        ([0], [0], [SRC + 1], ["length 65537", "ends past the source region", "65536 bytes"]),
        ([0], [DST - 10], [11], ["destination offset 65526", r"length 11\b",
                                 "ends past the destination region", "65536 bytes"]),
        ([SRC - 1], [0], [2], ["source offset 65535", r"length 2\b",
                               "ends past the source region"]),
        # These would overflow int64 if the check were written as off + len > size.
        ([2**63 - 1], [0], [1], ["source offset 9223372036854775807",
                                 "ends past the source region"]),
        ([0], [2**63 - 1], [1], ["destination offset 9223372036854775807",
                                 "ends past the destination region"]),
        ([0], [2**62], [SRC], ["destination offset 4611686018427387904",
                               "ends past the destination region"]),
        ([0], [0], [2**63 - 1], ["length 9223372036854775807", "ends past the source region"]),
    ],
    ids=["src-at-end", "src-far", "dst-at-end", "dst-second-piece", "len-past-src",
         "len-past-dst", "src-straddles-end", "src-max", "dst-max", "dst-huge", "len-max"],
)
def test_out_of_range_offsets(s: Setup, src: list[int], dst: list[int], length: list[int],
                              patterns: list[str]) -> None:
    with pytest.raises(ScatterError) as exc:
        s.write(pieces(src, dst, length))
    assert_names(exc.value, patterns)


@pytest.mark.parametrize(
    ("src", "dst", "length", "patterns"),
    [
        ([-1], [0], [1], [r"piece 0\b", r"-1\b", "negative (src|source) offset"]),
        ([0, 0], [0, -4096], [1, 1], [r"piece 1\b", "-4096",
                                      "negative (dst|destination) offset"]),
        ([0], [0], [0], [r"piece 0\b", r"length 0\b", "must be > 0"]),
        ([0, 0, 0], [0, 10, 20], [5, 5, -3], [r"piece 2\b", r"length -3\b", "must be > 0"]),
    ],
    ids=["negative-src", "negative-dst", "zero-length", "negative-length"],
)
def test_negative_offsets_and_empty_pieces(src: list[int], dst: list[int], length: list[int],
                                           patterns: list[str]) -> None:
    with pytest.raises(ScatterError) as exc:
        pieces(src, dst, length)
    assert_names(exc.value, patterns)


def test_arrays_of_different_lengths() -> None:
    with pytest.raises(ScatterError, match=r"differ in length: src=2 dst=1 lengths=2"):
        ScatterList(np.zeros(2, np.int64), np.zeros(1, np.int64), np.ones(2, np.int64))


def test_empty_scatter_list() -> None:
    with pytest.raises(ScatterError, match="empty"):
        ScatterList(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))


@pytest.mark.parametrize("dtype", [np.int32, np.uint64, np.float64, np.float32])
def test_wrong_dtype(dtype: type) -> None:
    good = np.ones(3, np.int64)
    with pytest.raises(ScatterError, match=f"lengths must have dtype int64, got {np.dtype(dtype)}"):
        ScatterList(good, good, np.ones(3, dtype))
    with pytest.raises(ScatterError, match="src offsets must have dtype int64"):
        ScatterList(np.zeros(3, dtype), good, good)


def test_not_arrays() -> None:
    good = np.ones(3, np.int64)
    with pytest.raises(ScatterError, match="dst offsets must be a numpy int64 array, got list"):
        ScatterList(good, [0, 1, 2], good)  # type: ignore[arg-type]


def test_two_dimensional_arrays() -> None:
    flat = np.ones(4, np.int64)
    with pytest.raises(ScatterError, match=r"one-dimensional, got shape \(2, 2\)"):
        ScatterList(flat.reshape(2, 2), flat.reshape(2, 2), flat.reshape(2, 2))
    with pytest.raises(ScatterError, match="lengths must be one-dimensional"):
        ScatterList(flat, flat, flat.reshape(4, 1))


def test_scatter_errors_are_value_errors() -> None:
    assert issubclass(ScatterError, InvalidArgument)
    assert issubclass(ScatterError, ValueError)
    assert issubclass(InvalidArgument, P2PXferError)


def test_scatter_must_be_a_scatter_list(s: Setup) -> None:
    raw = (np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64))
    with pytest.raises(InvalidArgument, match="scatter must be a ScatterList, got tuple"):
        s.write(raw)


# -- memory --------------------------------------------------------------------------

def test_read_only_bytes_cannot_be_exported(s: Setup) -> None:
    with pytest.raises(ReadOnlyBuffer, match="read-only bytes"):
        s.t.export(bytes(4096), "x")
    ro = np.zeros(4096, np.uint8)
    ro.setflags(write=False)
    with pytest.raises(ReadOnlyBuffer, match="read-only ndarray"):
        s.t.export(ro, "y")
    with pytest.raises(ReadOnlyBuffer, match="read-only"):
        s.t.register(bytes(10), writable=True)
    assert issubclass(ReadOnlyBuffer, InvalidArgument)


def test_read_only_registration_cannot_be_described(rail: Rail) -> None:
    cache = RegistrationCache([rail])
    try:
        region = cache.register(np.zeros(64, np.uint8))
        with pytest.raises(ReadOnlyBuffer, match="not registered for remote writes"):
            region.descriptor("z")
    finally:
        cache.close()


def test_read_only_bytes_are_a_fine_source(s: Setup) -> None:
    # The other side of the coin: a read-only buffer can be written *from*.
    data = bytes(range(256)) * 4
    s.t.register(data)
    # A dry run validates the source (registered, covering all of it) and posts nothing.
    assert s.t.write(data, s.desc, ScatterList.contiguous(len(data)), dry_run=True) == 1


def test_unregistered_source(s: Setup) -> None:
    with pytest.raises(UnregisteredMemory, match="are not registered: register the buffer"):
        s.write(ScatterList.contiguous(16), source=np.ones(SRC, np.uint8))
    # A buffer that only starts inside a registration is not covered by it.
    bigger = np.ones(2 * SRC, np.uint8)
    s.t.register(bigger[:SRC])
    with pytest.raises(UnregisteredMemory):
        s.write(ScatterList.contiguous(16), source=bigger)


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        ("a string", "does not support the buffer protocol"),
        (12345, "does not support the buffer protocol"),
        (np.zeros(0, np.uint8), "buffer is empty"),
        (np.zeros(64, np.uint8)[::2], "not contiguous"),
    ],
    ids=["str", "int", "empty", "strided"],
)
def test_unusable_buffers(s: Setup, obj: Any, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        s.t.register(obj)
    with pytest.raises(InvalidArgument, match=words):
        s.write(ScatterList.contiguous(1), source=obj)


# -- immediates ------------------------------------------------------------------------

@pytest.mark.parametrize("imm", [1 << 64, 1 << 100, -1, 1.0, "7"],
                         ids=["2^64", "2^100", "negative", "float", "str"])
def test_immediate_out_of_range(s: Setup, imm: Any) -> None:
    assert s.t.imm_bits == 64
    with pytest.raises(InvalidArgument, match="does not fit in 64 bits"):
        s.write(ScatterList.contiguous(16), imm=imm)
    with pytest.raises(InvalidArgument, match="does not fit in 64 bits"):
        s.t.wait_imm(imm, 1, timeout=0.01)


def test_wait_imm_count_must_be_positive(s: Setup) -> None:
    with pytest.raises(InvalidArgument, match="count must be an integer > 0, got 0"):
        s.t.wait_imm(IMM, 0)


def test_largest_immediate_is_accepted(engine: BlockingEngine) -> None:
    dst = np.zeros(64, np.uint8)
    desc = engine.export(dst, "top")
    src = np.full(64, 9, np.uint8)
    engine.register(src)
    top = (1 << 64) - 1
    n = engine.write(src, desc, ScatterList.contiguous(64), imm=top, timeout=10)
    engine.wait_imm(top, n, timeout=10)
    assert (dst == 9).all()


# -- providers and libfabric errors ------------------------------------------------------

@pytest.mark.parametrize("name", ["nope", "", "tcp;nope"])
def test_unknown_provider(name: str) -> None:
    with pytest.raises(ProviderNotFound) as exc:
        BlockingEngine.open(name)
    err = exc.value
    assert isinstance(err, FabricError) and isinstance(err, LookupError)
    assert err.call == "fi_getinfo"
    assert err.code == -int(lib.FI_ENODATA)
    assert repr(name) in str(err)
    assert str(err).startswith("fi_getinfo failed")


def test_getinfo_bogus_provider_is_a_fabric_error() -> None:
    with pytest.raises(FabricError) as exc:
        getinfo("bogus-provider", node="127.0.0.1")
    err = exc.value
    assert type(err) is ProviderNotFound
    assert (err.call, err.code) == ("fi_getinfo", -int(lib.FI_ENODATA))
    assert err.text and err.context and "bogus-provider" in err.context
    assert f"[{err.code}]" in str(err)


def test_fabric_error_carries_call_code_and_strerror(rail: Rail) -> None:
    # A real failure from a real object: one poller takes at most 16 CQs.
    with pytest.raises(FabricError) as exc:
        Poller([rail] * 17)
    err = exc.value
    assert err.call == "p2p_poller_add_cq"
    assert err.code == -int(lib.FI_ENOMEM)
    assert err.text == fi_strerror(lib.FI_ENOMEM) != ""
    assert err.context == "too many rails for one poller"
    assert str(err) == (f"p2p_poller_add_cq failed (too many rails for one poller): "
                        f"{err.text} [{err.code}]")


@pytest.mark.parametrize("code", ["FI_EAGAIN", "FI_EINVAL", "FI_ENOKEY", "FI_EAVAIL"])
def test_check_maps_every_negative_code(code: str) -> None:
    value = int(getattr(lib, code))
    assert check(0, "fi_x") == 0 and check(5, "fi_x") == 5
    with pytest.raises(FabricError) as exc:
        check(-value, "fi_x", "ctx")
    assert (exc.value.call, exc.value.code, exc.value.context) == ("fi_x", -value, "ctx")
    assert exc.value.text == fi_strerror(value) == fi_strerror(-value)


# -- descriptors -------------------------------------------------------------------------

def wire(desc: RegionDescriptor, **changes: Any) -> bytes:
    obj = desc.to_wire()
    for k, v in changes.items():
        if v is KeyError:
            del obj[k]
        else:
            obj[k] = v
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def test_descriptor_round_trip(s: Setup) -> None:
    again = RegionDescriptor.from_bytes(s.desc.to_bytes())
    assert again == s.desc
    assert again.rails[0].provider == s.t.provider


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x92\x01", b"\x91" * 100_000, b"garbage!", bytes(range(256)),
     msgpack.packb({"v": 1}) + b"x", "not bytes", None],
    ids=["empty", "reserved-byte", "truncated", "too-deep", "ascii", "all-bytes",
         "trailing", "str", "none"],
)
def test_garbage_descriptor(data: Any) -> None:
    with pytest.raises(DescriptorError, match="malformed region descriptor"):
        RegionDescriptor.from_bytes(data)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"v": 2}, "unsupported version 2"),
        ({"v": KeyError}, "unsupported version None"),
        ({"v": "1"}, "unsupported version '1'"),
        ({"name": KeyError}, "name must be a string"),
        ({"len": KeyError}, "len must be an integer > 0"),
        ({"rails": KeyError}, "rails must be a non-empty list"),
        ({"name": 5}, "name must be a string"),
        ({"node": b"bytes"}, "node must be a string"),
        ({"inc": -1}, "incarnation must be an integer >= 0"),
        ({"inc": "3"}, "incarnation must be an integer >= 0"),
        ({"len": "4096"}, "len must be an integer > 0"),
        ({"len": 0}, "len must be an integer > 0"),
        ({"len": 1.5}, "len must be an integer > 0"),
        ({"rails": []}, "rails must be a non-empty list"),
        ({"rails": {"a": 1}}, "rails must be a non-empty list"),
        ({"rails": [["shm", b"a", 1]]}, "rail 0 must be [provider, address, key, base]"),
        ({"rails": ["shm"]}, "rail 0 must be"),
        ({"rails": [[1, b"a", 1, 0]]}, "rail 0: provider must be a string"),
        ({"rails": [["shm", "addr", 1, 0]]}, "address non-empty bytes"),
        ({"rails": [["shm", b"", 1, 0]]}, "address non-empty bytes"),
        ({"rails": [["shm", b"a", -1, 0]]}, "rail 0: key must be an unsigned 64-bit integer"),
        ({"rails": [["shm", b"a", "k", 0]]}, "rail 0: key must be"),
        ({"rails": [["shm", b"a", 1, -5]]}, "rail 0: base must be an unsigned 64-bit"),
        ({"rails": [["shm", b"a", 1, 0], ["shm", b"b", 1, None]]}, "rail 1: base must be"),
        ({"extra": 1}, "unknown fields ['extra']"),
        ({"key": 1, "zz": 2}, "unknown fields ['key', 'zz']"),
    ],
)
def test_malformed_descriptor_fields(s: Setup, changes: dict[str, Any], words: str) -> None:
    with pytest.raises(DescriptorError) as exc:
        RegionDescriptor.from_bytes(wire(s.desc, **changes))
    assert "malformed region descriptor" in str(exc.value)
    assert words in str(exc.value)


def test_descriptor_must_be_a_map() -> None:
    with pytest.raises(DescriptorError, match="expected a map, got list"):
        RegionDescriptor.from_bytes(msgpack.packb([1, DESCRIPTOR_VERSION]))


def test_provider_mismatch_at_write_time(s: Setup) -> None:
    other = "shm" if s.t.provider != "shm" else "tcp;ofi_rxm"
    foreign = dataclasses.replace(
        s.desc, rails=tuple(dataclasses.replace(r, provider=other) for r in s.desc.rails))
    # It parses fine: which provider is right is only known where it is used.
    assert RegionDescriptor.from_bytes(foreign.to_bytes()) == foreign
    with pytest.raises(DescriptorError) as exc:
        s.write(ScatterList.contiguous(16), to=foreign)
    assert f"provider {other!r}" in str(exc.value)
    assert f"speaks {s.t.provider!r}" in str(exc.value)


@pytest.mark.parametrize("bad", [b"bytes", {"v": 1}, None], ids=["bytes", "dict", "none"])
def test_destination_must_be_a_descriptor(s: Setup, bad: Any) -> None:
    with pytest.raises(DescriptorError, match="destination must be a RegionDescriptor"):
        s.write(ScatterList.contiguous(16), to=bad)


def test_smaller_remote_region_bounds_the_write(s: Setup) -> None:
    # The descriptor's length is what the initiator checks against.
    short = dataclasses.replace(s.desc, length=100)
    with pytest.raises(ScatterError) as exc:
        s.write(pieces([0], [50], [51]), to=short)
    assert_names(exc.value, ["destination offset 50", "ends past the destination region",
                             "100 bytes"])


# -- a descriptor whose owner is gone ------------------------------------------------------
# Run in child processes: on shm one of these crashes the process that tries it.

GONE_ERRORS = {cls.__name__ for cls in (TransferError, *TransferError.__subclasses__(),
                                        PeerLost, RailsExhausted, DescriptorError)}


def export_and_leave(provider: str, node: str | None, results: Any) -> None:
    """Child: export a region, hand out its descriptor, close everything, exit."""
    with BlockingEngine.open(provider, node=node) as peer:
        results.put(peer.export(np.zeros(4096, np.uint8), "gone").to_bytes())


def write_to_departed(provider: str, node: str | None, desc: bytes | None, workdir: str,
                      results: Any) -> None:
    """Child: write to ``desc`` (``None``: export one here first, then close it)."""
    os.chdir(workdir)  # a crash report, if any, lands here and not in the checkout
    try:
        if desc is None:
            with BlockingEngine.open(provider, node=node) as peer:
                desc = peer.export(np.zeros(4096, np.uint8), "gone").to_bytes()
        with BlockingEngine.open(provider, node=node) as t:
            src = np.ones(4096, np.uint8)
            t.register(src)
            try:
                # A deadline far beyond the stall probe's: the error must
                # name the departed peer however slowly this child runs.
                t.write(src, RegionDescriptor.from_bytes(desc), ScatterList.contiguous(16),
                        imm=1, timeout=30)
            except P2PXferError as exc:
                results.put(f"{type(exc).__name__}: {exc}")
            else:
                results.put("no error")
    except BaseException:
        results.put(traceback.format_exc())


def test_write_to_a_peer_that_left_raises_remote_closed(
    provider: tuple[str, str | None], tmp_path: Path,
) -> None:
    # tcp: rxm answers -FI_EAGAIN forever for a refused connection; the stall
    # watch asks the peer's port after STALL_PROBE_S and finds it refused.
    ctx = mp.get_context("spawn")
    code, desc = run_child(ctx, export_and_leave, *provider)
    assert code == 0 and isinstance(desc, bytes)
    code, got = run_child(ctx, write_to_departed, *provider, desc, str(tmp_path))
    assert code == 0, f"writer died with exit code {code}: {got}"
    assert got is not None and got.split(":")[0] in GONE_ERRORS, got
    if provider[0].startswith("tcp"):
        assert got.startswith("PeerUnreachable") and "refuses connections" in got, got


def test_write_to_an_endpoint_closed_in_this_process_fails_cleanly(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    code, got = run_child(ctx, write_to_departed, "shm", None, None, str(tmp_path))
    assert code == 0, f"writer died with exit code {code}: {got}"
    assert got is not None and got.split(":")[0] in GONE_ERRORS, got


def test_a_gone_shm_peer_is_refused_before_any_provider_call() -> None:
    """libfabric 1.17's shm dies inserting or posting to a peer whose segment
    is gone, so every ``Rail.peer`` on shm looks for the segment first: a peer
    closed since its last write is ``PeerUnreachable``, not a crash."""
    from p2pxfer.errors import PeerUnreachable
    from p2pxfer.fabric import Rail

    with Rail.open("shm") as ours:
        peer = Rail.open("shm")
        try:
            addr = peer.address
            first = ours.peer(addr)
            assert ours.peer(addr) == first  # inserted once, looked up since
        finally:
            peer.close()
        with pytest.raises(PeerUnreachable, match="is gone"):
            ours.peer(addr)
        with pytest.raises(PeerUnreachable, match="is gone"):
            ours.peer(b"fi_shm://../etc/passwd\0")


def test_a_cursor_whose_shm_peer_went_fails_instead_of_raising() -> None:
    """After a teardown (the AV's epoch moved), a batch looks its peers up
    again before posting, in whichever thread posts; a shm peer gone by then
    fails that cursor, as a failed post does, and never raises there (in the
    poller thread an exception ended the loop: nothing posted again)."""
    from p2pxfer.fabric import Rail, WriteBatch
    from p2pxfer.fabric._binding import ffi

    with Rail.open("shm") as ours:
        peer = Rail.open("shm")
        try:
            addr = peer.address
            one = np.zeros(1, np.int64)
            batch = WriteBatch(one, one, one + 4096, 7, None, 1)
            batch.add(0, ours, ours.peer(addr), 0, 1, 0, ffi.NULL, 0, 0, addr)
        finally:
            peer.close()
        ours.av.remove(addr)  # a teardown: the epoch moves on
        batch.refresh()
        assert batch.posted  # nothing left to post: the cursor failed
        (why,) = batch.failures()
        assert why.startswith("posting piece 0 on rail 0 failed: No route to host"), why
        # A cursor added to a write under way (its notification, a failover's
        # share) fails the same way; planning a new write still raises.
        from p2pxfer.engine._plan import Target
        from p2pxfer.errors import PeerUnreachable

        t = Target(0, ours, addr, 0, 0, 0, ffi.NULL)
        assert t.add_to(batch, 0, 1, posting=True) == 1
        assert len(batch.failures()) == 2 and batch.posted
        with pytest.raises(PeerUnreachable, match="is gone"):
            t.add_to(batch, 0, 1)
