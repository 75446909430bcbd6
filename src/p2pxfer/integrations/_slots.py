"""String request ids (the engines') mapped to the small integers p2pxfer's
KV requests and immediates carry (``kv_plan.MAX_REQUEST``; 20-bit
immediates), and back.

Slots are reused first in, first out: an id freed now is the last to be
handed out again, so a late message about a request that ended (a push
that arrives after decode gave up) meets a slot nobody holds for as long
as possible. What must not live here: what a slot is for. Not thread-safe:
each table belongs to one thread (its owner says which).
"""

from __future__ import annotations

from collections import deque

from p2pxfer.errors import LimitExceeded

__all__ = ["SlotTable"]


class SlotTable:
    """Slots ``first..last`` for string keys."""

    def __init__(self, first: int, last: int, what: str) -> None:
        self.what = what
        self._free: deque[int] = deque(range(first, last + 1))
        self._by_key: dict[str, int] = {}
        self._by_slot: dict[int, str] = {}

    def take(self, key: str) -> int:
        """The slot of ``key``, taking a free one if it has none."""
        slot = self._by_key.get(key)
        if slot is not None:
            return slot
        if not self._free:
            raise LimitExceeded(f"every {self.what} slot ({len(self._by_slot)}) is held: "
                                f"cannot take one for request {key!r}")
        slot = self._free.popleft()
        self._by_key[key] = slot
        self._by_slot[slot] = key
        return slot

    def get(self, key: str) -> int | None:
        return self._by_key.get(key)

    def key(self, slot: int) -> str | None:
        return self._by_slot.get(slot)

    def release(self, key: str) -> int | None:
        """Free ``key``'s slot (if it holds one); the slot it held."""
        slot = self._by_key.pop(key, None)
        if slot is not None:
            del self._by_slot[slot]
            self._free.append(slot)
        return slot

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key
