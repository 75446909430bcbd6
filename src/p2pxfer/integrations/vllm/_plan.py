"""What the connector's scheduler side tells its worker side each step, what
a decode tells a prefill to start a push (a *pull*), and the names both
sides derive from an engine id. No vLLM, no I/O, no state.

The handshake needs no side channel: a prefill worker exports a small
``<engine>-r<rank>-pull`` region with one slot per held request (its
*key*); a decode worker writes its pull into that slot with the key as
the immediate (``Client.write(..., imm=key, notify=True)``), through its
own daemon; the prefill worker's wait for that immediate ends, it reads
the slot and pushes. Keys come from the prefill's scheduler (so no two
decodes write the same slot) and are reused first in, first out.

A slot holds a 4-byte little-endian length and a msgpack map: the prefill
request id it is for (a late pull for a key since reused is refused), the
decode's node, pool, optional checksum region and request number, how
many of the held blocks decode already has (``skip``), how long the
decode waits from now on (``within``, ms; pushed as computed), and the
decode's block ids (int32 little-endian ``bin``).

*Push as computed*: a proxy that sends a request to the prefill and the
decode at once gives both the same ``transfer_id``. The prefill worker
then exports the request's mailbox slots under a name of its own
(``pull_region``) as soon as the request is scheduled, the decode writes
its pull there (immediate: the decode's sub-slot), and each layer is
pushed as soon as the step that completes it has computed it (``Save.last``
carries the request's whole block table), not after the request finished.
The id stands where the prefill request id stands in a pull.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from p2pxfer.errors import InvalidArgument

__all__ = ["Load", "Open", "Pull", "Route", "Save", "Send", "Withdraw", "check_transfer_id",
           "decode_pull",
           "encode_pull", "pull_region", "pull_routes", "pull_slot_bytes", "region_names",
           "split"]

HEADER = struct.Struct("<I")
SLACK = 1024  # the map's keys, names and ids around the block table
MAX_TRANSFER_ID = 64
_TRANSFER_ID = re.compile(r"[A-Za-z0-9._:-]+")


@dataclass(frozen=True)
class Save:
    """Prefill: stage these blocks of ``request`` as each layer is computed
    this step (the blocks the step's tokens touch; a request's first step
    also its locally cached prefix)."""

    request: str
    blocks: tuple[int, ...]
    #: push as computed: this step computes the request's last prompt
    #: tokens, so each layer it saves is complete; ``table`` is every block
    #: of the prompt, in order
    last: bool = False
    table: tuple[int, ...] = ()


@dataclass(frozen=True)
class Open:
    """Prefill, push as computed: ``request`` was scheduled; its mailbox
    slots (under ``key``) take a decode's pull for ``transfer_id`` now."""

    request: str
    key: int
    transfer_id: str


@dataclass(frozen=True)
class Withdraw:
    """Prefill, push as computed: ``transfer_id`` will never be opened (its
    request was aborted before it was scheduled, or cannot be pushed as
    computed): a decode's pull hears ``reason`` and fails at once."""

    transfer_id: str
    reason: str


@dataclass(frozen=True)
class Send:
    """Prefill: ``request`` finished and is held under ``key`` (its blocks
    are not freed) until a decode pulls it or its lease passes. Pushed as
    computed (``transfer_id``): its pushes may end now; no ``blocks``:
    it was aborted, nothing more is pushed."""

    request: str
    key: int
    blocks: tuple[int, ...]
    transfer_id: str = ""


@dataclass(frozen=True)
class Load:
    """Decode: pull ``remote_blocks[skip:]`` of a held prefill request into
    ``blocks`` (from the prefill ranks ``pull_routes`` names)."""

    request: str
    node: str
    engine: str
    key: int
    remote_request: str
    skip: int
    blocks: tuple[int, ...]
    #: push as computed: the pull goes to ``pull_region`` (``key`` unused)
    transfer_id: str = ""


@dataclass(frozen=True)
class Pull:
    """A decoded pull."""

    prefill_request: str
    node: str
    pool: str
    sums: str  # "" when the decode asks for no checksums
    request: int
    skip: int
    blocks: npt.NDArray[np.int64]
    #: pushed as computed: milliseconds the decode waits from the pull on
    #: (no push starts after; 0: no limit)
    within_ms: int = 0


def split(tp: int, peer_tp: int) -> int:
    """Head slices per block in the staging pool of a rank of TP ``tp``
    whose peer runs TP ``peer_tp``: ``peer_tp / tp`` when the peer's ranks
    hold fewer heads, else 1. Sizes must divide one another."""
    if tp <= 0 or peer_tp <= 0 or (tp % peer_tp and peer_tp % tp):
        raise InvalidArgument(f"tensor parallel sizes {tp} and {peer_tp}: one must divide the "
                              "other")
    return peer_tp // tp if peer_tp > tp else 1


@dataclass(frozen=True)
class Route:
    """One pull of a decode rank: from prefill ``rank``, into mailbox
    sub-slot ``sub`` there (the head slice it pushes), landing in head
    slice ``part`` of the decode's staging blocks."""

    rank: int
    sub: int
    part: int
    #: an empty pull: the rank holds a replica nobody needs (MLA), let it go
    release: bool = False


def pull_routes(tp: int, rank: int, prefill_tp: int, replicated: bool = False
                ) -> list[Route]:
    """The pulls decode rank ``rank`` (of TP ``tp``) makes from a prefill of
    TP ``prefill_tp``: one, of head slice ``rank % k`` of prefill rank
    ``rank // k``, when the decode has ``k`` times the ranks; ``k`` when
    the prefill has ``k`` times the ranks, each a whole block of prefill
    rank ``rank*k + j`` into head slice ``j`` here. ``replicated`` (MLA:
    every rank holds the whole latent): whole blocks, from one rank."""
    split(tp, prefill_tp)
    if tp >= prefill_tp:
        k = tp // prefill_tp
        return [Route(rank // k, rank % k, 0)]
    k = prefill_tp // tp
    if replicated:
        return [Route(rank * k, 0, 0)] + [Route(rank * k + j, 0, 0, release=True)
                                          for j in range(1, k)]
    return [Route(rank * k + j, 0, j) for j in range(k)]


def region_names(engine: str, rank: int) -> tuple[str, str, str]:
    """(KV staging pool, pull mailbox, checksum region) of one worker."""
    base = f"vllm-{engine}-r{rank}"
    return base, f"{base}-pull", f"{base}-sums"


def check_transfer_id(tid: Any) -> str:
    """``tid`` if it can name a pull region: 1..64 of ``A-Za-z0-9._:-``."""
    if not isinstance(tid, str) or not 0 < len(tid) <= MAX_TRANSFER_ID \
            or not _TRANSFER_ID.fullmatch(tid):
        raise InvalidArgument(f"transfer_id must be 1..{MAX_TRANSFER_ID} of A-Z a-z 0-9 . _ : -, "
                              f"got {tid!r}")
    return tid


def pull_region(engine: str, rank: int, transfer_id: str) -> str:
    """The region a prefill worker takes the pulls of ``transfer_id`` in
    (its mailbox slots for the request, sub-slot ``j`` at ``j`` slots)."""
    return f"{region_names(engine, rank)[1]}-{check_transfer_id(transfer_id)}"


def pull_slot_bytes(max_blocks: int) -> int:
    """Bytes of one mailbox slot for requests of up to ``max_blocks`` blocks."""
    return HEADER.size + SLACK + 4 * max_blocks


def encode_pull(p: Pull, slot_bytes: int) -> bytes:
    body: bytes = msgpack.packb({"for": p.prefill_request, "node": p.node, "pool": p.pool,
                          "sums": p.sums, "request": p.request, "skip": p.skip,
                          "within": p.within_ms,
                          "blocks": np.ascontiguousarray(p.blocks, "<i4").tobytes()})
    data = HEADER.pack(len(body)) + body
    if len(data) > slot_bytes:
        raise InvalidArgument(f"a pull of {len(p.blocks)} blocks needs {len(data)} bytes, a "
                              f"mailbox slot holds {slot_bytes} (raise max_model_len?)")
    return data


def decode_pull(slot: npt.NDArray[np.uint8]) -> Pull:
    """The pull in a mailbox slot; ``InvalidArgument`` if it is malformed
    (whoever could write the slot is a peer, not trusted to be right)."""
    n = int(slot[:HEADER.size].view("<u4")[0])
    if n > len(slot) - HEADER.size:
        raise InvalidArgument(f"a pull claims {n} bytes in a {len(slot)}-byte slot")
    try:
        m: Any = msgpack.unpackb(slot[HEADER.size:HEADER.size + n].tobytes())
        blocks = np.frombuffer(m["blocks"], "<i4").astype(np.int64)
        return Pull(str(m["for"]), str(m["node"]), str(m["pool"]), str(m["sums"]),
                    int(m["request"]), int(m["skip"]), blocks, max(0, int(m.get("within", 0))))
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise InvalidArgument(f"malformed pull: {exc!r}") from exc
