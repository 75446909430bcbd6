"""The one transition table of both protocols.

Keys are (state, who sends, kind); the value is the next state. Anything not
in the table is a protocol error: local if we tried to send it, remote if it
arrived. Requests are legal only in READY, and only from the initiator (the
side that said hello); replies only from the responder, and only to an id that
is outstanding. What must not live here: field checks (``_messages.py``).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["INITIATOR", "RESPONDER", "State", "transition"]

INITIATOR = "initiator"
RESPONDER = "responder"


class State(Enum):
    IDLE = "idle"  # nothing said yet
    HELLO_SENT = "hello_sent"  # initiator said hello, waits for welcome
    READY = "ready"
    CLOSED = "closed"


_REPLIES = frozenset({"ok", "error"})

TABLE: dict[tuple[State, str, str], State] = {
    (State.IDLE, INITIATOR, "hello"): State.HELLO_SENT,
    (State.HELLO_SENT, RESPONDER, "welcome"): State.READY,
    (State.HELLO_SENT, RESPONDER, "error"): State.CLOSED,
    (State.READY, RESPONDER, "ok"): State.READY,
    (State.READY, RESPONDER, "error"): State.READY,
    (State.READY, INITIATOR, "bye"): State.CLOSED,
    (State.READY, RESPONDER, "bye"): State.CLOSED,
}


def transition(state: State, sender: str, kind: str, requests: frozenset[str]) -> State | None:
    """Next state, or None when the table forbids it."""
    if state is State.READY and sender == INITIATOR and kind in requests:
        return State.READY
    return TABLE.get((state, sender, kind))


def is_reply(kind: str) -> bool:
    return kind in _REPLIES
