"""How long will a write or a KV push take? A cost model, fitted on this
machine, asked before the transfer.

A *profile* (``Profile``) holds, per provider and NICs, three costs measured
by ``p2pxfer bench --calibrate`` (``p2pxfer.bench.calibrate``) and fitted by
least squares in relative error over a handful of shapes (one piece of 4 KiB
to 32 MiB, thousands of 4-64 KiB random pages):

    seconds = latency + pieces_per_rail * per_piece + bytes_per_rail * per_byte

``latency`` is what one transfer costs whatever its size (posting, the
completion's round trip, waking the caller); ``per_piece`` what each piece
adds (descriptors, the provider's per-message work); ``per_byte`` the
inverse of one rail's bandwidth. ``predict`` applies it to a scatter list
(pieces as posted: the engine cuts pieces larger than a rail's share and
stripes them over the rails by bytes) or a KV push (``predict_kv``: pieces
after the same coalescing as the push, one transfer per layer, layers
pipelined, so the fixed cost is paid once), and names what bounds it: the
largest of the three terms.

No fabric here, no I/O but the profile file. What must not live here:
measuring (``p2pxfer.bench``), the push's planning itself (``kv_plan``).
"""

from __future__ import annotations

import json
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

__all__ = ["PROFILE_VERSION", "Point", "Prediction", "Profile", "ProfileMissing", "fit",
           "load_profile", "predict", "predict_kv", "profile_path", "save_profile"]

PROFILE_VERSION = 1
BOUNDS = ("latency", "pieces", "bandwidth")


class ProfileMissing(P2PXferError):
    """No calibration profile for a provider: run ``p2pxfer bench --calibrate``."""

    code = "bad_request"


@dataclass(frozen=True)
class Point:
    """One calibration measurement: a transfer of ``pieces`` pieces and
    ``nbytes`` bytes over ``rails`` rails took ``seconds`` (median)."""

    pieces: int
    nbytes: int
    seconds: float
    rails: int = 1
    label: str = ""


@dataclass(frozen=True)
class Profile:
    """The fitted costs of one provider on this machine's NICs."""

    provider: str
    latency_s: float
    per_piece_s: float
    per_byte_s: float
    nics: tuple[str, ...] = ()
    host: str = field(default_factory=platform.node)
    created: float = field(default_factory=time.time)
    #: the measurements it was fitted on, each with the model's value
    points: tuple[dict[str, Any], ...] = ()
    #: CPU seconds per GB of both ends, as the bench measured it (None: unknown)
    cpu_s_per_gb: float | None = None

    @property
    def gbps(self) -> float:
        """One rail's bandwidth the model assumes (GB/s)."""
        return 1e-9 / self.per_byte_s if self.per_byte_s > 0 else float("inf")

    def seconds(self, pieces: float, nbytes: float, rails: int = 1) -> float:
        return self.latency_s + pieces / rails * self.per_piece_s \
            + nbytes / rails * self.per_byte_s

    def to_json(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, obj: Any, where: str = "profile") -> Profile:
        try:
            if obj.get("version") != PROFILE_VERSION:
                raise ValueError(f"version {obj.get('version')!r}, not {PROFILE_VERSION}")
            lat, piece, byte = (float(obj[k]) for k in ("latency_s", "per_piece_s",
                                                         "per_byte_s"))
            if not min(lat, piece, byte) >= 0:
                raise ValueError("a cost is negative")
            return cls(str(obj["provider"]), lat, piece, byte, nics=tuple(obj.get("nics", ())),
                       host=str(obj.get("host", "")), created=float(obj.get("created", 0)),
                       points=tuple(obj.get("points", ())),
                       cpu_s_per_gb=obj.get("cpu_s_per_gb"))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"{where} is not a calibration profile: {exc}") from None


@dataclass(frozen=True)
class Prediction:
    """What ``predict`` expects of one transfer (or KV push)."""

    seconds: float
    pieces: int  # as posted (after coalescing, cut to rail shares)
    nbytes: int
    rails: int
    bound: str  # "latency", "pieces" or "bandwidth": the largest term
    terms: dict[str, float]  # seconds of each term
    transfers: int = 1  # a KV push: one per layer

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}


def fit(provider: str, points: Sequence[Point], *, nics: Sequence[str] = (),
        cpu_s_per_gb: float | None = None) -> Profile:
    """Least squares in relative error (every shape counts alike, a 4 KiB
    write as much as a 1 GiB one), the three costs kept >= 0: a cost that
    comes out negative is dropped and the others fitted again."""
    if len(points) < 3:
        raise InvalidArgument(f"a fit needs at least 3 measurements, got {len(points)}")
    a = np.array([[1.0, p.pieces / p.rails, p.nbytes / p.rails] for p in points])
    t = np.array([p.seconds for p in points])
    if not (t > 0).all():
        raise InvalidArgument("every measurement must have taken > 0 s")
    keep = [0, 1, 2]
    coef = np.zeros(3)
    while keep:
        sol, *_ = np.linalg.lstsq(a[:, keep] / t[:, None], np.ones(len(t)), rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[keep] = sol
            break
        keep.pop(int(np.argmin(sol)))
    prof = Profile(provider, float(coef[0]), float(coef[1]), float(coef[2]), nics=tuple(nics),
                   cpu_s_per_gb=cpu_s_per_gb)
    fitted = tuple({**asdict(p), "model_s": prof.seconds(p.pieces, p.nbytes, p.rails)}
                   for p in points)
    return Profile(prof.provider, prof.latency_s, prof.per_piece_s, prof.per_byte_s,
                   nics=prof.nics, points=fitted, cpu_s_per_gb=cpu_s_per_gb)


def _terms(profile: Profile, pieces: float, nbytes: float,
           rails: int) -> tuple[float, dict[str, float], str]:
    terms = {"latency": profile.latency_s,
             "pieces": pieces / rails * profile.per_piece_s,
             "bandwidth": nbytes / rails * profile.per_byte_s}
    bound = max(BOUNDS, key=lambda k: terms[k])
    return sum(terms.values()), terms, bound


def rail_pieces(scatter: ScatterList, rails: int) -> int:
    """The pieces a write of ``scatter`` posts over ``rails`` rails: as the
    engine stripes it (by bytes, cutting pieces that straddle a rail's
    share)."""
    if rails <= 1 or len(scatter) == 0:
        return len(scatter)
    sl, _ = scatter.stripe(rails)
    return len(sl)


def predict(profile: Profile, scatter: ScatterList, *, rails: int = 1) -> Prediction:
    """One write of ``scatter`` over ``rails`` rails."""
    if rails < 1:
        raise InvalidArgument(f"rails must be >= 1, got {rails}")
    pieces = rail_pieces(scatter, rails)
    seconds, terms, bound = _terms(profile, pieces, scatter.nbytes, rails)
    return Prediction(seconds, pieces, scatter.nbytes, rails, bound, terms)


def predict_kv(profile: Profile, layout: KVLayout, src_blocks: Any, dst_blocks: Any, *,
               layers: Iterable[int] | None = None, rails: int = 1) -> Prediction:
    """A KV push of ``src_blocks`` into ``dst_blocks`` (same layout both
    sides), every layer or ``layers``: pieces after coalescing as the push
    does them, one transfer per layer submitted back to back (their fixed
    costs overlap: paid once)."""
    lays, so, do, ln, counts = plan_push(layout, layout, src_blocks, dst_blocks, layers,
                                         src_size=layout.nbytes, dst_size=layout.nbytes)
    pieces = len(ln)
    if rails > 1:  # each layer is striped on its own
        ends = np.cumsum(counts)
        pieces = sum(rail_pieces(ScatterList(so[e - c:e], do[e - c:e], ln[e - c:e]), rails)
                     for e, c in zip(ends.tolist(), counts.tolist(), strict=True))
    nbytes = int(ln.sum())
    seconds, terms, bound = _terms(profile, pieces, nbytes, rails)
    return Prediction(seconds, pieces, nbytes, rails, bound, terms, transfers=len(lays))


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
