"""The soak: minutes of verified writes (``p2pxfer.hostile``'s loop) while a
thread flaps a link, the daemons' fds and RSS sampled as it goes; shared by
``tests/daemon/test_hostile_netns.py`` and ``bench/soak.py``.

- ``Flapper``: a thread taking a link down and up, over and over.
- ``sample``: a process's open fds and RSS.

What must not live here: the loop itself (``p2pxfer.hostile``) or namespace
set-up. The flapper's thread owns only its stop event.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2pxfer.hostile import HostLike, LoopSpec, rail_daemons, run_loop
from p2pxfer.log import get_logger
from p2pxfer.testing import LaunchError

__all__ = ["Flapper", "sample", "soak", "status_kib"]

log = get_logger("p2pxfer.hostile")

SAMPLE_EVERY_S = 30.0  # a soak samples the daemons' fds and RSS this often


def status_kib(pid: int, field: str) -> int:
    """A memory field of ``/proc/PID/status`` in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise LookupError(f"no {field} in /proc/{pid}/status")


def sample(pid: int) -> dict[str, int]:
    """Open descriptors and resident memory (KiB) of process ``pid``."""
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "rss_kib": status_kib(pid, "VmRSS")}


class Flapper:
    """A thread that calls ``set_link(False)``, waits ``down_s``, calls
    ``set_link(True)``, waits ``up_s``, and so on until ``stop`` (which leaves
    the link up). ``flaps`` counts the cuts."""

    def __init__(self, set_link: Callable[[bool], None], down_s: float, up_s: float) -> None:
        self.set_link, self.down_s, self.up_s = set_link, down_s, up_s
        self.flaps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2pxfer-flapper", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.set_link(False)
                self.flaps += 1
                self._stop.wait(self.down_s)
                self.set_link(True)
                self._stop.wait(self.up_s)
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self) -> None:
        """Stop flapping, the link up (also when the thread failed)."""
        self._stop.set()
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join(60)
        self.set_link(True)
        if self.error is not None:
            raise LaunchError(f"the flapper failed: {self.error!r}") from self.error


def soak(workdir: Path, writer: HostLike, target: HostLike,
         set_link: Callable[[bool], None], *, seconds: float, down_s: float = 10.0,
         up_s: float = 10.0, deadline_s: float = 5.0, warmup: int = 3,
         seed: int = 1, delivery_complete: bool = False) -> dict[str, Any]:
    """A soak: daemons on ``writer`` and ``target`` striping over their
    rails, writes in a loop for ``seconds`` while ``set_link`` cuts a link
    ``down_s`` and heals it ``up_s``, over and over (from round ``warmup``
    on); an ok write's pieces must arrive within ``deadline_s`` too
    (``incomplete`` if not). ``delivery_complete``: the daemons' key of that
    name. Returns the loop's summary, the flaps, each daemon's fds and RSS
    after the warm-up and at the end (the link up again, clients still
    connected), and the problem rounds."""
    with rail_daemons(workdir, [writer, target], write_timeout_s=deadline_s,
                      delivery_complete=delivery_complete) as ds:
        flapper = Flapper(set_link, down_s, up_s)
        samples: dict[str, dict[str, dict[str, int]]] = {}

        series: list[dict[str, Any]] = []  # every SAMPLE_EVERY_S: the trend

        def take(when: str) -> None:
            samples[when] = {d.name: sample(d.proc.pid) for d in ds}

        def on_round(rec: dict[str, Any]) -> None:
            if rec["round"] == warmup:
                take("start")
                flapper.start()
            if rec["round"] >= warmup and (not series
                                           or rec["t"] - series[-1]["t"] >= SAMPLE_EVERY_S):
                series.append({"t": rec["t"], "round": rec["round"],
                               **{d.name: sample(d.proc.pid) for d in ds}})

        def at_end() -> None:
            flapper.stop()
            time.sleep(2.0)  # connections torn down by the last failures are gone
            take("end")

        spec = LoopSpec(ds[0].socket, ds[1].socket, ds[1].name, deadline_s, seconds=seconds,
                        seed=seed, imm_wait_s=deadline_s)
        try:
            report = run_loop(spec, on_round=on_round, at_end=at_end)
        finally:
            flapper.stop()
        statuses = {d.name: d.status() for d in ds}
        return {
            **report.summary(), "seconds": seconds, "down_s": down_s, "up_s": up_s,
            "deadline_s": deadline_s, "delivery_complete": delivery_complete,
            "flaps": flapper.flaps, "daemons": samples, "daemon_series": series,
            "nic_inflight_end": {n: [nic["inflight"] for nic in s["nics"]]
                                 for n, s in statuses.items()},
            "nic_bytes": {n: [nic["bytes"] for nic in s["nics"]] for n, s in statuses.items()},
            "nic_errors": {n: [nic["errors"] for nic in s["nics"]]
                           for n, s in statuses.items()},
            "problems": report.problems()[:20],
            "alive": {d.name: d.alive() for d in ds},
        }
