"""The message side of ``Swim``: ``receive`` and a handler per datagram kind.

``_SwimReceiving`` opens and checks each datagram, applies the sender's
record and its gossip, and answers: acks to pings (and relays for
``swim_ping_req``), the two-way challenge of a join, and full-state
exchanges (``swim_welcome``, ``swim_sync``) when views disagree.

What must not live here: timers and probe scheduling (``_swim_probe.py``),
the membership rules and sending (``_swim_core.py``), sockets.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from ._member import BadDatagram
from ._swim_core import _SwimCore
from ._swim_types import _HEADER_SLACK, _MAX_PENDING_CHALLENGES, Outgoing, _rec_size
from ._wire import TAG_SIZE, Record, SwimMessage, WireError, decode


class _SwimReceiving(_SwimCore):
    """``receive``: one datagram in, the answers out."""

    def receive(self, data: bytes, source: str, now: float, via: int = 0) -> list[Outgoing]:
        """Handle one datagram from ``source`` (``host:port``) that came to our
        address number ``via``. Answers go back to ``source`` from there."""
        self._start(now)
        self._stats.received += 1
        self._stats.bytes_received += len(data)
        try:
            msg = decode(self._auth.open(data))
        except WireError as exc:
            if exc.authentic:
                self._stats.bad_datagrams += 1
                self._events.append(BadDatagram(source, exc.reason))
            else:
                self._auth_failed(source, exc.reason)
            return []
        kind, sender = msg.kind, msg.sender
        if sender[0] == self._self.name and sender[2] == self._self.incarnation:
            return []  # our own datagram, echoed
        if self._leaving:
            # Only answer pings, so whoever still probes us hears we left.
            if kind == "swim_ping" and msg.to == self._self.name:
                return [self._send("swim_ack", source, sender[0], seq=msg.seq, via=via)]
            return []
        if kind == "swim_join":
            return self._on_join(msg, source, via, now)
        if kind == "swim_challenge":
            return self._on_challenge(msg, source, via)
        # Everything else: the sender speaks for itself first, then its gossip.
        self._apply(sender, now, direct=True)
        for rec in msg.updates:
            self._apply(rec, now, direct=False)
        if kind == "swim_ping":
            if msg.to != self._self.name:
                return []  # meant for whoever had this address before us
            out = [self._send("swim_ack", source, sender[0], seq=msg.seq, via=via)]
            return out + self._maybe_sync(msg, source, via, now)
        if kind == "swim_ack":
            return self._on_ack(msg, now) + self._maybe_sync(msg, source, via, now)
        if kind == "swim_ping_req":
            return self._on_ping_req(msg, source, via, now)
        if kind in ("swim_welcome", "swim_sync"):
            for rec in msg.members:
                self._apply(rec, now, direct=False)
            if kind == "swim_sync":
                return self._full_state("swim_sync", sender, source, via) if msg.reply else []
            if self._join_nonce is not None:
                self._joined = True
                self._join_nonce = None
                self._next_join = math.inf
        return []  # swim_leave: the sender's record said it all

    # -- handlers -------------------------------------------------------------

    def _on_ack(self, msg: SwimMessage, now: float) -> list[Outgoing]:
        p = self._probe
        responder = msg.on_behalf or msg.sender[0]
        if p is not None and responder == p.target and (
                p.seq <= msg.seq < p.seq + p.naddr if msg.on_behalf is None
                else msg.seq == p.seq):
            p.acked = True
            if (e := self._members.get(p.target)) is not None:
                e.last_heard = now
                if msg.on_behalf is None and e.incarnation == p.incarnation:
                    i = msg.seq - p.seq
                    p.answered.add(i)
                    if i < len(e.missed):
                        e.missed[i] = 0
                    self._show_paths(e)
            return []
        relay = self._relays.get(msg.seq) if msg.on_behalf is None else None
        if relay is not None and relay[4] == msg.sender[0]:
            del self._relays[msg.seq]
            address, via, name, seq, target, _ = relay
            return [self._send("swim_ack", address, name, seq=seq, on_behalf=target, via=via)]
        return []

    def _on_ping_req(self, msg: SwimMessage, source: str, via: int,
                     now: float) -> list[Outgoing]:
        assert msg.target is not None
        target = msg.target[0]
        if target == self._self.name:
            return [self._send("swim_ack", source, msg.sender[0], seq=msg.seq,
                               on_behalf=target, via=via)]
        known = self._members.get(target)
        addresses = known.addresses if known is not None else (msg.target[1], *msg.target[5])
        self._seq += 1
        self._relays[self._seq] = (source, via, msg.sender[0], msg.seq, target,
                                   now + self.config.period)
        # Every address, one seq: the first ack is forwarded.
        return [self._send("swim_ping", a, target, seq=self._seq, to=target, via=self._via(i))
                for i, a in enumerate(addresses)]

    def _on_join(self, msg: SwimMessage, source: str, via: int,
                 now: float) -> list[Outgoing]:
        sender = msg.sender
        if msg.challenge is None or msg.proof is None:
            # Step 1: prove we hold the token on their nonce, and challenge them.
            if len(self._challenges) >= _MAX_PENDING_CHALLENGES:
                self._expire_challenges(now)
                if len(self._challenges) >= _MAX_PENDING_CHALLENGES:
                    return []
            challenge = secrets.token_bytes(16)
            lifetime = 4 * max(self.config.join_retry, self.config.period)
            self._challenges[challenge] = (sender[0], now + lifetime)
            return [self._send("swim_challenge", source, None, nonce=msg.nonce,
                               proof=self._auth.prove(msg.nonce, self._self.name),
                               challenge=challenge, via=via)]
        # Step 2: they answered our challenge.
        pending = self._challenges.pop(msg.challenge, None)
        if pending is None or pending[0] != sender[0] or pending[1] < now:
            self._auth_failed(source, f"join from {sender[0]!r} answers no pending challenge")
            return []
        if not self._auth.check(msg.challenge, sender[0], msg.proof):
            self._auth_failed(source, f"join from {sender[0]!r} failed the challenge")
            return []
        self._apply(sender, now, direct=True)
        return self._full_state("swim_welcome", sender, source, via)

    def _on_challenge(self, msg: SwimMessage, source: str, via: int) -> list[Outgoing]:
        if self._join_nonce is None or msg.nonce != self._join_nonce:
            return []  # an answer to a join we no longer wait for
        assert msg.proof is not None and msg.challenge is not None
        if not self._auth.check(msg.nonce, msg.sender[0], msg.proof):
            self._auth_failed(source, f"seed {msg.sender[0]!r} failed the challenge")
            return []
        return [self._send("swim_join", source, None, nonce=self._join_nonce,
                           challenge=msg.challenge,
                           proof=self._auth.prove(msg.challenge, self._self.name), via=via)]

    def _maybe_sync(self, msg: SwimMessage, source: str, via: int,
                    now: float) -> list[Outgoing]:
        """Views disagree and gossip had its chance: exchange full states with
        the sender (push-pull), at most once per ``sync_interval``. This
        ends the long tail of a dissemination that died out before reaching
        everyone (mass joins, heavy loss, a healed partition)."""
        if msg.digest is None or msg.digest == self.digest() or now < self._next_sync \
                or now - self._view_changed < self.config.sync_quiet:
            return []
        self._next_sync = now + self.config.sync_interval
        self._stats.syncs += 1
        return self._full_state("swim_sync", msg.sender, source, via, reply=True)

    def _full_state(self, kind: str, to: Record, address: str, via: int,
                    **first: Any) -> list[Outgoing]:
        """Every member we know (tombstones too), to ``address`` from our
        ``via``, in as many datagrams as it takes; ``first``'s fields go on
        the first datagram only."""
        budget = self.config.max_datagram - TAG_SIZE - 1 - _HEADER_SLACK \
            - _rec_size(self._self.record())
        out: list[Outgoing] = []
        chunk: list[Record] = []
        room = budget
        for e in self._members.values():
            if e.name == to[0]:
                continue
            rec = e.record()
            size = _rec_size(rec)
            if size > room and chunk:
                out.append(self._send(kind, address, None, members=chunk, via=via, **first))
                chunk, room, first = [], budget, {}
            chunk.append(rec)
            room -= size
        out.append(self._send(kind, address, None, members=chunk, via=via, **first))
        return out
