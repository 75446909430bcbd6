"""How long will a write or a KV push take? A cost model, measured on this
machine, asked before the transfer.

A *profile* (``Profile``) holds, per provider and NICs, two cost curves over
the size of a piece, measured by ``p2pxfer bench --calibrate``
(``p2pxfer.bench.calibrate``):

- ``single``: how long a transfer of one lone piece of that size takes (the
  fixed cost of a transfer, its round trip, and that piece's bytes unhidden);
- ``stream``: what each further piece of that size adds to a transfer of
  many, pieces in flight together (the provider's per-message work and the
  bytes at the rate a stream of such pieces moves).

A transfer of pieces ``s_1 >= s_2 >= ...`` over ``rails`` rails is predicted as

    seconds = single(s_1) + (stream(s_2) + stream(s_3) + ...) / rails

Two constants beside the curves, each measured by the calibration too:

- ``per_transfer_s``: what each further transfer costs when many are
  submitted back to back (a KV push's layers: each a notified write of its
  own, with its Python on both of the engine's threads); a push of ``L``
  layers adds ``(L - 1) * per_transfer_s``;
- ``shared_scale``: how much slower the pieces move between shared-memory
  buffers (memfd pages, as a daemon's pools and its clients' shares are) than
  between private ones (anonymous memory, which the kernel backs with huge
  pages; shm's CMA copies walk every 4 KiB page of shared memory). It scales
  the stream curve's part of a prediction with ``shared=True``.

Between measured sizes a curve is linear in the size (a cost per message
plus a cost per byte within one protocol regime); past the largest it goes
on at the last segment's cost per byte. Curves rather than three constants,
because the providers' costs are not one line: ``ofi_rxm`` changes protocol
at its eager limit, and a lone large piece moves slower than a stream of
them. ``predict`` applies the model to a scatter list (pieces as posted: the
engine cuts pieces larger than a rail's share and stripes them over the
rails by bytes) or a KV push (``predict_kv``: pieces after the push's own
coalescing, one transfer per layer submitted back to back, so the fixed cost
is paid once, each further layer ``per_transfer_s``), and names what bounds
it: the largest of its terms (the fixed cost, the cost of the pieces as
messages, the bytes at the peak rate, the cost of the push's transfers).

No fabric here, no I/O but the profile file. What must not live here:
measuring (``p2pxfer.bench``), the push's planning itself (``kv_plan``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from p2pxfer.errors import InvalidArgument, P2PXferError
from p2pxfer.kv_plan import KVLayout, plan_push
from p2pxfer.scatter import ScatterList

__all__ = ["MEMORY", "PROFILE_VERSION", "Point", "Prediction", "Profile", "ProfileMissing",
           "find_profile", "fit", "load_profile", "predict", "predict_kv", "profile_path",
           "save_profile"]

PROFILE_VERSION = 2
BOUNDS = ("latency", "pieces", "bandwidth", "transfers")
MEMORY = ("private", "shared")
#: a knot's cost is never taken below this (a curve of zeros predicts nothing)
MIN_COST_S = 1e-9

Knots = tuple[tuple[int, float], ...]


class ProfileMissing(P2PXferError):
    """No calibration profile for a provider: run ``p2pxfer bench --calibrate``."""

    code = "bad_request"


@dataclass(frozen=True)
class Point:
    """One calibration measurement: ``pieces`` pieces of equal size,
    ``nbytes`` in all, over ``rails`` rails, as ``transfers`` transfers
    submitted together (of ``pieces / transfers`` pieces each), between
    ``memory`` (``private`` or ``shared``) buffers, took ``seconds`` (median)."""

    pieces: int
    nbytes: int
    seconds: float
    rails: int = 1
    label: str = ""
    transfers: int = 1
    memory: str = "private"

    @property
    def piece_size(self) -> int:
        return max(1, self.nbytes // max(1, self.pieces))

    @property
    def plain(self) -> bool:
        """One transfer between private buffers: what the curves are fitted on."""
        return self.transfers == 1 and self.memory == "private"


def _curve(knots: Knots, sizes: np.ndarray) -> np.ndarray:
    """The cost of pieces of ``sizes`` on a curve of (size, seconds) knots:
    linear between knots, flat below the first, on at the last segment's
    cost per byte past the last."""
    xs = np.array([k[0] for k in knots], dtype=np.float64)
    ys = np.array([k[1] for k in knots], dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.float64)
    out: np.ndarray = np.interp(sizes, xs, ys)
    past = sizes > xs[-1]
    out[past] = ys[-1] + (sizes[past] - xs[-1]) * _tail_slope(knots)
    return out


def _tail_slope(knots: Knots) -> float:
    """A curve's cost per byte past its last knot: its last segment's slope,
    or where that is flat (one knot, or two made equal by the envelope) the
    last knot's average cost per byte."""
    (x1, y1), (x0, y0) = knots[-1], knots[-2] if len(knots) >= 2 else (0, 0.0)
    slope = (y1 - y0) / (x1 - x0) if len(knots) >= 2 else 0.0
    return slope if slope > 0 else y1 / x1


def _check_knots(obj: Any, name: str) -> Knots:
    knots = tuple((int(size), float(cost)) for size, cost in obj)
    if not knots:
        raise ValueError(f"{name} has no measurements")
    sizes = [k[0] for k in knots]
    if sizes != sorted(set(sizes)) or sizes[0] < 1:
        raise ValueError(f"{name}'s sizes are not positive and increasing")
    if not all(cost > 0 for _, cost in knots):
        raise ValueError(f"{name} has a cost <= 0")
    return knots


@dataclass(frozen=True)
class Profile:
    """The measured costs of one provider on this machine's NICs: two curves
    over piece size (see the module's docstring), each a tuple of
    (bytes, seconds) knots in increasing size."""

    provider: str
    single: Knots
    stream: Knots
    nics: tuple[str, ...] = ()
    host: str = field(default_factory=platform.node)
    created: float = field(default_factory=time.time)
    #: the measurements it was fitted on, each with the model's value
    points: tuple[dict[str, Any], ...] = ()
    #: CPU seconds per GB of both ends, as the bench measured it (None: unknown)
    cpu_s_per_gb: float | None = None
    #: each further transfer submitted back to back (see the module's docstring)
    per_transfer_s: float = 0.0
    #: the stream's cost between shared-memory buffers over private ones
    shared_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "single", _check_knots(self.single, "single"))
        object.__setattr__(self, "stream", _check_knots(self.stream, "stream"))
        if not (0 <= self.per_transfer_s < math.inf and 0 < self.shared_scale < math.inf):
            raise ValueError(f"per_transfer_s {self.per_transfer_s} must be >= 0 and "
                             f"shared_scale {self.shared_scale} > 0, both finite")

    @property
    def latency_s(self) -> float:
        """The fixed cost of a transfer: one lone piece of the smallest size measured."""
        return self.single[0][1]

    @property
    def per_piece_s(self) -> float:
        """What each further piece of the smallest size measured adds."""
        return self.stream[0][1]

    @property
    def per_byte_s(self) -> float:
        """The cost of a byte at the peak rate: the stream curve's slope past
        its last knot (its inverse is one rail's bandwidth)."""
        return _tail_slope(self.stream)

    @property
    def gbps(self) -> float:
        """One rail's bandwidth the model assumes (GB/s)."""
        return 1e-9 / self.per_byte_s if self.per_byte_s > 0 else float("inf")

    def scale(self, shared: bool) -> float:
        """What the stream's costs are multiplied by between ``shared`` buffers."""
        return self.shared_scale if shared else 1.0

    def transfer_seconds(self, lengths: np.ndarray, rails: int = 1, *,
                         shared: bool = False) -> float:
        """A transfer of pieces of ``lengths`` bytes spread over ``rails``
        (between ``shared`` memory buffers: the stream scaled)."""
        if len(lengths) == 0:
            return self.latency_s
        lengths = np.asarray(lengths)
        big = int(np.argmax(lengths))
        stream = float(_curve(self.stream, lengths).sum()
                       - _curve(self.stream, lengths[big:big + 1])[0])
        return (float(_curve(self.single, lengths[big:big + 1])[0])
                + self.scale(shared) * stream / rails)

    def seconds(self, pieces: int, nbytes: int, rails: int = 1, *, transfers: int = 1,
                shared: bool = False) -> float:
        """``pieces`` equal pieces, ``nbytes`` in all, as ``transfers``
        transfers submitted together (between ``shared`` memory buffers)."""
        size = max(1, nbytes // max(1, pieces))
        lone = float(_curve(self.single, np.array([size]))[0])
        each = float(_curve(self.stream, np.array([size]))[0])
        return (lone + self.scale(shared) * max(0, pieces - 1) * each / rails
                + max(0, transfers - 1) * self.per_transfer_s)

    def to_json(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, obj: Any, where: str = "profile") -> Profile:
        try:
            if obj.get("version") != PROFILE_VERSION:
                raise ValueError(f"version {obj.get('version')!r}, not {PROFILE_VERSION} "
                                 f"(calibrate again)")
            return cls(str(obj["provider"]), obj["single"], obj["stream"],
                       nics=tuple(obj.get("nics", ())), host=str(obj.get("host", "")),
                       created=float(obj.get("created", 0)),
                       points=tuple(obj.get("points", ())),
                       cpu_s_per_gb=obj.get("cpu_s_per_gb"),
                       # absent from profiles saved before they were measured
                       per_transfer_s=float(obj.get("per_transfer_s", 0.0)),
                       shared_scale=float(obj.get("shared_scale", 1.0)))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"{where} is not a calibration profile: {exc}") from None


@dataclass(frozen=True)
class Prediction:
    """What ``predict`` expects of one transfer (or KV push)."""

    seconds: float
    pieces: int  # as posted (after coalescing, cut to rail shares)
    nbytes: int
    rails: int
    bound: str  # "latency", "pieces", "bandwidth" or "transfers": the largest term
    terms: dict[str, float]  # seconds of each term; they add up to ``seconds``
    transfers: int = 1  # a KV push: one per layer

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}


def _envelope(values: Sequence[float]) -> list[float]:
    """The lower non-decreasing envelope: each cost no more than any larger
    piece's. A larger piece never costs less; a measurement slower than a
    larger piece's was disturbed (here: both spinning ends of a loopback
    transfer sharing one CPU, 50-60 us for a lone 64 KiB shm piece that
    takes 8), and is lowered rather than averaged into its neighbours."""
    out = list(values)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def _knots(pairs: dict[int, list[float]]) -> Knots:
    sizes = sorted(pairs)
    costs = _envelope([float(np.median(pairs[s])) for s in sizes])
    return tuple((s, max(MIN_COST_S, c)) for s, c in zip(sizes, costs, strict=True))


def fit(provider: str, points: Sequence[Point], *, nics: Sequence[str] = (),
        cpu_s_per_gb: float | None = None) -> Profile:
    """The curves through ``points``: transfers of one piece make the
    ``single`` curve; transfers of many equal pieces the ``stream`` curve, as
    what each piece past the first added to a lone one of its size. Each
    curve is the lower non-decreasing envelope of its measurements (a larger
    piece never costs less: ``_envelope``). Both from ``Point.plain``
    measurements; then, on those curves, what the others add:
    ``per_transfer_s`` from many transfers submitted together (their time
    past one transfer of the same pieces, per further transfer) and
    ``shared_scale`` from one transfer between shared buffers (its stream
    past the private one's, where its time is past a lone piece's); the
    median of each, 0 and 1 where none. (A batched point's time is the mean
    of its rounds: the bench times a round of transfers as a whole.)"""
    if not all(p.seconds > 0 and p.pieces >= 1 and p.nbytes >= 1 and p.rails >= 1
               and 1 <= p.transfers <= p.pieces and p.memory in MEMORY for p in points):
        raise InvalidArgument("every measurement must be of >= 1 piece and byte, of 1 to "
                              f"pieces transfers, between {' or '.join(MEMORY)} buffers, "
                              "and have taken > 0 s")
    lone: dict[int, list[float]] = {}
    many: list[Point] = []
    for p in points:
        if not p.plain:
            continue
        if p.pieces == 1:
            lone.setdefault(p.nbytes, []).append(p.seconds)
        else:
            many.append(p)
    if not lone or not many:
        raise InvalidArgument(f"a fit needs transfers of one piece and of many pieces, got "
                              f"{len(lone)} sizes of one piece and {len(many)} of many")
    single = _knots(lone)
    each: dict[int, list[float]] = {}
    for p in many:
        first = float(_curve(single, np.array([p.piece_size]))[0])
        each.setdefault(p.piece_size, []).append(
            max(0.0, p.seconds - first) * p.rails / (p.pieces - 1))
    prof = Profile(provider, single, _knots(each), nics=tuple(nics), cpu_s_per_gb=cpu_s_per_gb)
    per_transfer = [max(0.0, p.seconds - prof.seconds(p.pieces, p.nbytes, p.rails))
                    / (p.transfers - 1)
                    for p in points if p.memory == "private" and p.transfers > 1]
    scale = []
    for p in points:
        if p.memory != "shared" or p.transfers != 1 or p.pieces == 1:
            continue
        lone_s = prof.seconds(1, p.piece_size, p.rails)
        if p.seconds > lone_s:
            scale.append((p.seconds - lone_s) / (prof.seconds(p.pieces, p.nbytes, p.rails)
                                                 - lone_s))
    prof = dataclasses.replace(
        prof, per_transfer_s=float(np.median(per_transfer)) if per_transfer else 0.0,
        shared_scale=float(np.median(scale)) if scale else 1.0)
    fitted = tuple({**asdict(p), "model_s": prof.seconds(
        p.pieces, p.nbytes, p.rails, transfers=p.transfers, shared=p.memory == "shared")}
        for p in points)
    return dataclasses.replace(prof, points=fitted)


def _prediction(profile: Profile, lengths: np.ndarray, rails: int,
                transfers: int = 1, shared: bool = False) -> Prediction:
    """The model on pieces of ``lengths``, with its terms: the fixed cost
    (a lone smallest piece), the bytes at the peak rate, what the pieces
    cost as messages beyond both (what is left), and what the further
    transfers of a push cost as such."""
    nbytes = int(lengths.sum())
    seconds = profile.transfer_seconds(lengths, rails, shared=shared)
    fixed = min(profile.latency_s, seconds)
    wire = min(profile.scale(shared) * nbytes / rails * profile.per_byte_s, seconds - fixed)
    extra = max(0, transfers - 1) * profile.per_transfer_s
    terms = {"latency": fixed, "pieces": seconds - fixed - wire, "bandwidth": wire,
             "transfers": extra}
    bound = max(BOUNDS, key=lambda k: terms[k])
    return Prediction(seconds + extra, len(lengths), nbytes, rails, bound, terms, transfers)


def _posted(scatter: ScatterList, rails: int) -> np.ndarray:
    """The lengths of the pieces a write of ``scatter`` posts over
    ``rails`` rails: as the engine stripes it (by bytes, cutting pieces that
    straddle a rail's share)."""
    if rails <= 1 or len(scatter) == 0:
        return np.asarray(scatter.length)
    sl, _ = scatter.stripe(rails)
    return np.asarray(sl.length)


def predict(profile: Profile, scatter: ScatterList, *, rails: int = 1,
            shared: bool = False) -> Prediction:
    """One write of ``scatter`` over ``rails`` rails; ``shared``: between
    shared-memory buffers (a write through a daemon, from a client's share)."""
    if rails < 1:
        raise InvalidArgument(f"rails must be >= 1, got {rails}")
    return _prediction(profile, _posted(scatter, rails), rails, shared=shared)


def predict_kv(profile: Profile, layout: KVLayout, src_blocks: Any, dst_blocks: Any, *,
               layers: Iterable[int] | None = None, rails: int = 1,
               shared: bool = False) -> Prediction:
    """A KV push of ``src_blocks`` into ``dst_blocks`` (same layout both
    sides), every layer or ``layers``: pieces after coalescing as the push
    does them, one transfer per layer submitted back to back (their fixed
    costs overlap: paid once; each further layer costs ``per_transfer_s``).
    ``shared``: between shared-memory pools (a push through daemons)."""
    if rails < 1:
        raise InvalidArgument(f"rails must be >= 1, got {rails}")
    lays, so, do, ln, counts = plan_push(layout, layout, src_blocks, dst_blocks, layers,
                                         src_size=layout.nbytes, dst_size=layout.nbytes)
    lengths = np.asarray(ln)
    if rails > 1:  # each layer is striped on its own
        ends = np.cumsum(counts)
        lengths = np.concatenate([
            _posted(ScatterList(so[e - c:e], do[e - c:e], ln[e - c:e]), rails)
            for e, c in zip(ends.tolist(), counts.tolist(), strict=True)])
    return _prediction(profile, lengths, rails, transfers=len(lays), shared=shared)


# -- the profile file ------------------------------------------------------------------


def profile_path(provider: str, directory: str | os.PathLike[str] | None = None) -> Path:
    """Where the profile of ``provider`` lives: ``directory``, else
    ``$P2PXFER_PROFILE_DIR``, else ``$XDG_CACHE_HOME/p2pxfer`` (``~/.cache``)."""
    base = directory or os.environ.get("P2PXFER_PROFILE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "p2pxfer"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in provider)
    return Path(base) / f"profile-{safe}.json"


def save_profile(profile: Profile, path: str | os.PathLike[str] | None = None) -> Path:
    """Write ``profile`` (atomically) to ``path`` or its ``profile_path``."""
    target = Path(path) if path is not None else profile_path(profile.provider)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    tmp.replace(target)
    return target


def load_profile(provider: str, path: str | os.PathLike[str] | None = None) -> Profile:
    """The profile of ``provider`` (``ProfileMissing`` if none was saved)."""
    source = Path(path) if path is not None else profile_path(provider)
    try:
        text = source.read_text()
    except FileNotFoundError:
        raise ProfileMissing(f"no calibration profile for {provider!r} at {source}: run "
                             f"`p2pxfer bench --calibrate --provider '{provider}'` first") \
            from None
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{source} is not JSON: {exc}") from None
    profile = Profile.from_json(obj, str(source))
    if profile.provider != provider:
        raise InvalidArgument(f"{source} is the profile of {profile.provider!r}, not "
                              f"{provider!r}")
    return profile


def find_profile(provider: str) -> Profile | None:
    """The saved profile of ``provider``, or None where none was saved (the
    bench's predictions: a missing profile is no error there)."""
    try:
        return load_profile(provider)
    except ProfileMissing:
        return None
