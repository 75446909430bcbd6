"""The etcd backend: members are keys under a lease, changes come by watch.

Each daemon keeps ``<prefix><name>`` (default ``/p2pxfer/members/<name>``)
attached to a lease it keeps alive; the value is JSON ``{"v": 1, "name",
"address", "incarnation", "state": "alive"|"left", "mac"}``, the MAC taken
under the cluster token so a writer without it cannot inject members.
Everyone watches the prefix:

- a put of a new name or a higher incarnation: ``MemberJoined`` /
  ``MemberRestarted``; ``state: left``: ``MemberLeft`` (a graceful stop puts
  that, then revokes the lease);
- a delete of a running member (its lease expired: it stopped keeping it
  alive): ``MemberDead``; with ``host_check`` (on in the daemon), first
  ``MemberSuspect`` while its host is asked whether its process is still
  there (``check_host``): a process starved of the CPU on a busy host
  lets its lease lapse like a dead one, then puts its key back with the
  same incarnation (``MemberAlive``). A refusal is the verdict at once, no
  answer at the end of the check, and a host that keeps accepting is asked
  again (twice as far apart each time) for up to ``starved_grace``.

It speaks etcd's v3 JSON gateway over plain HTTP (httpx, under trio): no
gRPC stack. Keys and values are base64 there; int64s are strings.
What must not live here: anything about regions or transfers.
"""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from typing import Any

import httpx
import trio

from ._backend import MembershipBackend, MembershipError
from ._hostcheck import check_host
from ._member import (
    AuthFailed,
    Member,
    MemberAlive,
    MemberDead,
    MemberJoined,
    MemberLeft,
    MemberRestarted,
    MembershipEvent,
    MemberState,
    MemberSuspect,
    Superseded,
    new_incarnation,
)
from ._wire import ClusterAuth

__all__ = ["EtcdBackend"]

VALUE_VERSION = 1
KEEPALIVE_RETRY_S = 0.25  # a failed lease keepalive is tried again this soon, then later
#: a renewal this many intervals after the last one that worked is logged:
#: what let the lease get near its end (a starved daemon, a slow etcd)
KEEPALIVE_LATE = 2.0


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _prefix_end(prefix: bytes) -> bytes:
    """The end of the key range that holds every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class EtcdBackend(MembershipBackend):
    """Membership through etcd at ``endpoint`` (``http://host:port``).

    ``address`` is what others should reach this daemon at (its control
    address); ``ttl`` the lease in seconds: a daemon that stops keeping its
    lease alive is seen dead about ``ttl`` seconds later (etcd rounds small
    TTLs up to its minimum, about 2 s with default timings). Dead and left
    members are remembered ``tombstone`` seconds. ``host_check`` (seconds;
    0: off) and ``starved_grace``: a member whose lease lapsed is suspect
    while its host still accepts (see the module's docstring).
    """

    def __init__(self, name: str, address: str, token: bytes,
                 endpoint: str = "http://127.0.0.1:2379", *, incarnation: int | None = None,
                 ttl: int = 5, prefix: str = "/p2pxfer/members/", tombstone: float = 60.0,
                 timeout: float = 5.0, host_check: float = 0.0,
                 starved_grace: float = 10.0) -> None:
        super().__init__(name, new_incarnation() if incarnation is None else incarnation)
        if not prefix or ttl < 1:
            raise MembershipError("EtcdBackend needs a prefix and ttl >= 1")
        if host_check < 0 or starved_grace < host_check:
            raise MembershipError("EtcdBackend needs 0 <= host_check <= starved_grace")
        self.address = address
        self.endpoint = endpoint
        self.ttl = ttl
        self.prefix = prefix
        self._key = (prefix + name).encode()
        self._auth = ClusterAuth(token)
        self._tombstone = tombstone
        self._timeout = timeout
        self._host_check = host_check
        self._starved_grace = starved_grace
        self._nursery: trio.Nursery | None = None
        self._client: httpx.AsyncClient | None = None
        self._lease = ""
        self._lease_lost = trio.Event()
        self._view: dict[str, Member] = {}
        self._since: dict[str, float] = {}  # when a dead/left member became so
        self._pending: list[MembershipEvent] = []
        self._superseded = False
        self._auth_failures = 0

    # -- views --------------------------------------------------------------------

    def detection_bound(self) -> float:
        # The lease runs out (etcd may round it up a little), the watch tells
        # us, and a host that does not refuse gets its check.
        return self.ttl + 2.0 + self._host_check

    def members(self) -> list[Member]:
        return sorted(self._view.values(), key=lambda m: m.name)

    def member(self, name: str) -> Member | None:
        return self._view.get(name)

    # -- etcd calls ----------------------------------------------------------------

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self._client is not None
        try:
            resp = await self._client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise MembershipError(f"etcd at {self.endpoint}: {path}: {exc!r}") from exc
        try:
            data = resp.json()
        except ValueError:
            data = {}
        if resp.status_code != 200 or not isinstance(data, dict) or "error" in data:
            what = data.get("message") or data.get("error") if isinstance(data, dict) else None
            raise MembershipError(f"etcd at {self.endpoint}: {path}: HTTP {resp.status_code} "
                                  f"{what or resp.text[:200]}")
        return data

    async def _grant(self) -> None:
        data = await self._call("/v3/lease/grant", {"TTL": str(self.ttl)})
        self._lease = str(data["ID"])

    async def _put_self(self, state: str) -> None:
        fields = {"v": VALUE_VERSION, "name": self.name, "address": self.address,
                  "incarnation": self.incarnation, "state": state}
        mac = self._auth.sign(_canonical(fields)).hex()
        value = json.dumps({**fields, "mac": mac}, sort_keys=True).encode()
        await self._call("/v3/kv/put", {"key": _b64(self._key), "value": _b64(value),
                                        "lease": self._lease})

    async def _resync(self) -> int:
        """Read every member key; bring the view in line; the revision read at."""
        prefix = self.prefix.encode()
        data = await self._call("/v3/kv/range", {"key": _b64(prefix),
                                                 "range_end": _b64(_prefix_end(prefix))})
        now = trio.current_time()
        present = set()
        for kv in data.get("kvs", ()):
            name = self._put(kv, now)
            if name is not None:
                present.add(name)
        for name, m in list(self._view.items()):
            if name != self.name and m.running and name not in present:
                self._delete(name, now)
        self._flush()
        return int(data["header"]["revision"])

    # -- running ------------------------------------------------------------------

    async def _run(self, *, task_status: trio.TaskStatus[None]) -> None:
        # trust_env=False: membership traffic goes to the configured endpoint,
        # never through a proxy picked up from the environment.
        self._client = httpx.AsyncClient(base_url=self.endpoint, timeout=self._timeout,
                                         trust_env=False)
        now = trio.current_time()
        self._view[self.name] = Member(self.name, self.address, self.incarnation,
                                       MemberState.ALIVE, now)
        await self._grant()
        await self._put_self("alive")
        revision = await self._resync()
        self.log.info("membership.started", backend="etcd", endpoint=self.endpoint,
                      members=len(self._view))
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._keepalive_loop)
            nursery.start_soon(self._watch_loop, revision + 1)
            task_status.started()

    async def _keepalive_loop(self) -> None:
        # Renewals are timed from the start of the last one that worked, not
        # from the end of the last call: a slow answer or a starved turn
        # must not stretch the gap towards the TTL. A failed one is tried
        # again soon.
        interval = max(self.ttl / 3, 0.2)
        last_ok = trio.current_time()  # the lease was just granted
        next_at = last_ok + interval
        retry = KEEPALIVE_RETRY_S
        renew = False  # a new lease (and our key on it) is due
        while True:
            with trio.move_on_at(next_at):
                await self._lease_lost.wait()
            if self._lease_lost.is_set():
                self._lease_lost = trio.Event()
                renew = True
            started = trio.current_time()
            try:
                if not renew:
                    data = await self._call("/v3/lease/keepalive", {"ID": self._lease})
                    if int(data.get("result", {}).get("TTL", 0)) <= 0:
                        self.log.warning("membership.lease_lost", lease=self._lease,
                                         since_last_s=round(trio.current_time() - last_ok, 3))
                        renew = True
                    else:
                        now = trio.current_time()
                        if now - last_ok > KEEPALIVE_LATE * interval:
                            self.log.warning("membership.keepalive_late", lease=self._lease,
                                             since_last_s=round(now - last_ok, 3),
                                             ttl=self.ttl)
                        last_ok = now
                        me = self._view[self.name]
                        self._view[self.name] = replace(me, last_heard=now)
                if renew:
                    # Until both are done: a new lease may hold no key of ours.
                    await self._renew()
                    renew = False
                    last_ok = trio.current_time()
                next_at, retry = started + interval, KEEPALIVE_RETRY_S
            except MembershipError as exc:
                self.log.warning("membership.keepalive_failed", error=str(exc),
                                 retry_s=min(interval, retry))
                next_at = trio.current_time() + min(interval, retry)
                retry *= 2  # etcd may be down a while: do not hammer it
            self._purge(trio.current_time())

    async def _renew(self) -> None:
        await self._grant()
        await self._put_self("alive")

    async def _watch_loop(self, revision: int) -> None:
        while True:
            try:
                await self._watch(revision)
            except (MembershipError, httpx.HTTPError, ValueError, KeyError) as exc:
                self.log.warning("membership.watch_failed", error=str(exc))
            # Whatever broke, read the whole prefix again and watch from there.
            delay = 0.25
            while True:
                await trio.sleep(delay)
                try:
                    revision = await self._resync() + 1
                    break
                except MembershipError as exc:
                    self.log.warning("membership.resync_failed", error=str(exc))
                    delay = min(2 * delay, 5.0)

    async def _watch(self, revision: int) -> None:
        assert self._client is not None
        prefix = self.prefix.encode()
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
                                   "start_revision": str(revision)}}
        timeout = httpx.Timeout(self._timeout, read=None)
        async with self._client.stream("POST", "/v3/watch", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                raise MembershipError(f"etcd watch: HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                obj = json.loads(line)
                if "error" in obj:
                    raise MembershipError(f"etcd watch: {obj['error']}")
                result = obj.get("result", {})
                if result.get("canceled"):
                    raise MembershipError(f"etcd watch canceled: "
                                          f"{result.get('cancel_reason', 'compacted')}")
                now = trio.current_time()
                for ev in result.get("events", ()):
                    kv = ev.get("kv", {})
                    if ev.get("type") == "DELETE":
                        key = _unb64(kv.get("key", "")).decode(errors="replace")
                        self._delete(key[len(self.prefix):], now)
                    else:
                        self._put(kv, now)
                self._flush()
        raise MembershipError("etcd closed the watch stream")

    async def _say_goodbye(self) -> None:
        if self._client is None or not self._lease:
            return
        await self._put_self("left")
        await self._call("/v3/lease/revoke", {"ID": self._lease})

    async def _close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # -- the view -----------------------------------------------------------------

    def _put(self, kv: dict[str, Any], now: float) -> str | None:
        """Apply one key's value; the member's name, or None if refused."""
        key = _unb64(kv.get("key", "")).decode(errors="replace")
        try:
            obj = json.loads(_unb64(kv.get("value", "")))
            mac = bytes.fromhex(obj.pop("mac"))
            ok = self._auth.verify(_canonical(obj), mac)
            name, address = obj["name"], obj["address"]
            inc, state = obj["incarnation"], obj["state"]
            ok = ok and obj.get("v") == VALUE_VERSION and key == self.prefix + name \
                and isinstance(address, str) and type(inc) is int and state in ("alive", "left")
        except (ValueError, TypeError, KeyError, AttributeError):
            ok = False
        if not ok:
            self._auth_failures += 1
            if self._auth_failures & (self._auth_failures - 1) == 0:
                self._pending.append(AuthFailed(f"etcd:{key}", "value without a valid MAC "
                                                "under the cluster token", self._auth_failures))
            return None
        self._apply_put(name, address, inc,
                        MemberState.LEFT if state == "left" else MemberState.ALIVE, now)
        return str(name)

    def _apply_put(self, name: str, address: str, inc: int, state: MemberState,
                   now: float) -> None:
        if name == self.name:
            if inc > self.incarnation and not self._superseded:
                self._superseded = True
                self._pending.append(Superseded(Member(name, address, inc, state, now)))
            return
        old = self._view.get(name)
        new = Member(name, address, inc, state, now)
        if old is not None and inc < old.incarnation:
            return  # an earlier life's last words
        if old is None or inc > old.incarnation:
            self._set(new, now)
            if state is MemberState.ALIVE:
                self._pending.append(MemberRestarted(new, old.incarnation)
                                     if old is not None and old.running else MemberJoined(new))
            elif old is not None and old.running:
                self._pending.append(MemberLeft(new))
            return
        if state is MemberState.LEFT:
            if old.state is not MemberState.LEFT:
                self._set(new, now)
                if old.running:
                    self._pending.append(MemberLeft(new))
            return
        if old.state is MemberState.ALIVE:
            self._view[name] = replace(old, address=address, last_heard=now)
        else:  # a suspect whose lease had lapsed (starved), or back from dead
            self._set(new, now)  # same life back (its lease had lapsed)
            self._pending.append(MemberAlive(new))

    def _delete(self, name: str, now: float) -> None:
        if name == self.name:
            if not self._stopped:
                self.log.warning("membership.own_key_deleted")
                self._lease_lost.set()
            return
        old = self._view.get(name)
        if old is None or not old.running:
            return
        if old.state is MemberState.SUSPECT:
            return  # its host is being asked already
        if self._host_check > 0 and self._nursery is not None:
            suspect = replace(old, state=MemberState.SUSPECT)
            self._set(suspect, now)
            self._pending.append(MemberSuspect(suspect))
            self._nursery.start_soon(self._settle, suspect)
            return
        self._declare_dead(old, now)

    def _declare_dead(self, m: Member, now: float) -> None:
        dead = replace(m, state=MemberState.DEAD)
        self._set(dead, now)
        self._pending.append(MemberDead(dead))

    async def _settle(self, suspect: Member) -> None:
        """``suspect``'s key went (its lease lapsed): dead unless its host
        still accepts, asked again while it does, for up to ``starved_grace``.
        Over as soon as the member is no longer this suspect (it put its key
        back, restarted or left): the view's entry is no longer this very
        object (a lease that lapses again later makes a new suspect, with a
        settling of its own and its own grace)."""
        since = trio.current_time()
        wait = self._host_check
        while self._view.get(suspect.name) is suspect:
            verdict, why = await check_host(suspect.address, self._host_check * 0.8)
            now = trio.current_time()
            self.log.info("membership.host_checked", member=suspect.name, verdict=verdict,
                          why=why)
            if self._view.get(suspect.name) is not suspect:
                return
            if verdict != "answered" or now - since >= self._starved_grace:
                self._declare_dead(suspect, now)
                self._flush()
                return
            await trio.sleep(min(wait, max(since + self._starved_grace - now, 0.0)))
            wait = min(2 * wait, 16 * self._host_check)

    def _set(self, m: Member, now: float) -> None:
        self._view[m.name] = m
        if m.running:
            self._since.pop(m.name, None)
        else:
            self._since[m.name] = now

    def _flush(self) -> None:
        events, self._pending = self._pending, []
        self._publish(events)

    def _purge(self, now: float) -> None:
        for name, since in list(self._since.items()):
            if since + self._tombstone <= now:
                del self._since[name]
                self._view.pop(name, None)


def _canonical(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
