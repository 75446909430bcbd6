"""Fuzzing the doors beside the four in ``test_fuzz_daemon.py``: the TLS
control port (bytes that are not TLS at all, and fuzzed frames inside a
properly authenticated TLS session), and what a peer *answers* (a configured
peer that says hello and then replies to the daemon's requests with anything
at all: wrong kinds, wrong ids, wrong fields, huge containers, garbage).

Whatever arrives, the daemon must not crash, must answer its own client
with a named error (never hang, never ``internal`` with a traceback), and
must go on serving everyone else. Hypothesis draws the cases.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon_helpers import LOOPBACK, DaemonProc, free_port, start_daemon
from fuzz_values import values as _values
from p2pxfer.cli import main
from p2pxfer.client import SyncClient
from p2pxfer.errors import ConnectionLost, P2PXferError
from p2pxfer.protocol import SCHEMA, SCHEMA_VERSION, FrameDecoder, encode_frame
from p2pxfer.scatter import ScatterList

_CASES = settings(max_examples=300, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))



@st.composite
def _frame(draw: st.DrawFn) -> bytes:
    """A frame: a real kind with random fields, a random map, random bytes
    behind a length prefix, or a prefix that lies."""
    choice = draw(st.integers(0, 3))
    if choice == 0:
        msg = {"t": draw(st.sampled_from(sorted(SCHEMA)))}
        for name in SCHEMA[msg["t"]]:
            if draw(st.booleans()):
                msg[name] = draw(_values)
        return encode_frame(msg, 1 << 20)
    if choice == 1:
        return encode_frame(draw(st.dictionaries(st.text(max_size=6), _values, max_size=4)),
                            1 << 20)
    body = draw(st.binary(max_size=64))
    length = len(body) if choice == 2 else draw(st.integers(0, (1 << 32) - 1))
    return length.to_bytes(4, "big") + body


def _status_ok(d: DaemonProc) -> None:
    assert d.alive(), d.log_tail()
    with SyncClient(d.socket) as c:
        assert c.status()["node"] == d.name


# -- the TLS door ----------------------------------------------------------------------


def _cli(*args: str) -> None:
    r = CliRunner().invoke(main, ["certs", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, ssl.SSLContext]]:
    """node-a with mutual TLS; a client context holding node-b's certificate."""
    pki = tmp_path_factory.mktemp("pki")
    _cli("init", str(pki / "ca"))
    for node in ("node-a", "node-b"):
        _cli("issue", "--ca", str(pki / "ca"), "--name", node, "--host", LOOPBACK,
             "--out", str(pki / node))
    d = start_daemon(tmp_path_factory.mktemp("d"), "node-a", control_port=free_port(),
                     tls_ca=str(pki / "node-a" / "ca.crt"),
                     tls_cert=str(pki / "node-a" / "node-a.crt"),
                     tls_key=str(pki / "node-a" / "node-a.key"))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(str(pki / "node-b" / "ca.crt"))
    ctx.load_cert_chain(str(pki / "node-b" / "node-b.crt"), str(pki / "node-b" / "node-b.key"))
    try:
        yield d, ctx
    finally:
        d.stop()


def _control(d: DaemonProc) -> tuple[str, int]:
    host, port = d.control.rsplit(":", 1)
    return host, int(port)


def _drain(sock: socket.socket) -> list[dict[str, Any]]:
    """Everything the daemon says until it hangs up, each frame checked."""
    decoder, frames = FrameDecoder(1 << 24), []
    while True:
        try:
            data = sock.recv(1 << 16)
        except (OSError, ssl.SSLError):  # a timeout too: nothing more is coming
            data = b""
        if not data:
            return frames
        decoder.feed(data)
        while (obj := decoder.next_frame()) is not None:
            assert obj.get("t") in ("welcome", "ok", "error"), obj
            if obj["t"] == "error":
                assert isinstance(obj["code"], str) and len(obj["message"]) < 1000, obj
            frames.append(obj)


@_CASES
@given(junk=st.binary(min_size=1, max_size=2048))
def test_fuzz_tls_door_with_bytes_that_are_not_tls(
        tls: tuple[DaemonProc, ssl.SSLContext], junk: bytes) -> None:
    d, _ = tls
    with socket.create_connection(_control(d), timeout=10) as sock:
        try:
            sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # hung up already
        # Not a TLS handshake: nothing in our framing ever comes back.
        assert _drain(sock) == []


@settings(_CASES, max_examples=80)
@given(greet=st.booleans(), frames=st.lists(_frame(), min_size=1, max_size=4))
def test_fuzz_tls_door_inside_an_authenticated_session(
        tls: tuple[DaemonProc, ssl.SSLContext], greet: bool, frames: list[bytes]) -> None:
    d, ctx = tls
    raw = socket.create_connection(_control(d), timeout=10)
    with ctx.wrap_socket(raw) as sock:
        hello = encode_frame({"t": "hello", "v": SCHEMA_VERSION, "role": "daemon",
                              "name": "node-b"}, 1 << 20) if greet else b""
        with contextlib.suppress(OSError, ssl.SSLError):
            sock.sendall(hello + b"".join(frames))
        # No half-close here (it would end TLS on our side): what the daemon
        # says comes at once; a session it keeps open is left after a moment.
        sock.settimeout(0.3)
        _drain(sock)


def test_the_tls_daemon_still_serves(tls: tuple[DaemonProc, ssl.SSLContext]) -> None:
    _status_ok(tls[0])


# -- peer answers ----------------------------------------------------------------------


class FakePeer:
    """A configured peer that says hello as a daemon would, then answers each
    request it gets with the next of ``script`` (frames drawn by a case; the
    request's id put in where a frame has a ``{id}`` slot), and hangs up."""

    def __init__(self) -> None:
        self.listener = socket.create_server((LOOPBACK, 0))
        self.port = self.listener.getsockname()[1]
        self.script: list[Any] = []
        self.welcome: Any = None
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                self._talk(conn)

    def _talk(self, conn: socket.socket) -> None:
        conn.settimeout(1)
        decoder = FrameDecoder(1 << 24)
        script = list(self.script)
        try:
            while True:
                data = conn.recv(1 << 16)
                if not data:
                    return
                decoder.feed(data)
                while (msg := decoder.next_frame()) is not None:
                    if msg.get("t") == "hello":
                        conn.sendall(self.welcome)
                    elif "id" in msg:
                        if not script:
                            return
                        conn.sendall(_fill(script.pop(0), msg["id"]))
        except (OSError, ValueError):
            return

    def close(self) -> None:
        self._stop = True
        self.listener.close()
        self._thread.join(5)


def _fill(reply: Any, rid: int) -> bytes:
    if isinstance(reply, bytes):
        return reply
    obj = dict(reply)
    if obj.get("id") == "{id}":
        obj["id"] = rid
    body = msgpack.packb(obj)
    return len(body).to_bytes(4, "big") + body


_GOOD_WELCOME = {"t": "welcome", "v": SCHEMA_VERSION, "node": "fake", "incarnation": 1,
                 "max_frame": 1 << 20}


@st.composite
def _answer(draw: st.DrawFn) -> Any:
    """A reply to one request: ok or error with anything in it, a huge
    container, another kind, another id, or a raw frame."""
    choice = draw(st.integers(0, 4))
    rid: Any = "{id}" if draw(st.integers(0, 4)) else draw(_values)
    if choice == 0:
        return {"t": "ok", "id": rid, "result": draw(st.one_of(
            _values, st.dictionaries(st.sampled_from(
                ["descriptor", "slot", "nodes", "regions", "tag", "done"]), _values,
                max_size=4)))}
    if choice == 1:
        return {"t": "error", "id": rid, "code": draw(st.one_of(st.text(max_size=20), _values)),
                "message": draw(st.one_of(st.text(max_size=40), _values))}
    if choice == 2:  # containers far past any limit a request gets
        n = draw(st.sampled_from([1 << 16, 1 << 20]))
        return {"t": "ok", "id": rid, "result": {"descriptor": [[]] * n}}
    if choice == 3:
        return {"t": draw(st.sampled_from(sorted(SCHEMA))), "id": rid}
    return draw(_frame())


@pytest.fixture(scope="module")
def dialer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, FakePeer]]:
    fake = FakePeer()
    d = start_daemon(tmp_path_factory.mktemp("dialer"), "node-a", control_port=free_port(),
                     peers=[{"name": "fake", "address": f"{LOOPBACK}:{fake.port}"}])
    try:
        yield d, fake
    finally:
        d.stop()
        fake.close()


@settings(_CASES, max_examples=150)
@given(good_welcome=st.booleans(), welcome=_frame(),
       answers=st.lists(_answer(), min_size=1, max_size=3))
def test_fuzz_peer_answers(dialer: tuple[DaemonProc, FakePeer], good_welcome: bool,
                           welcome: bytes, answers: list[Any]) -> None:
    d, fake = dialer
    fake.welcome = _fill(_GOOD_WELCOME, 0) if good_welcome else welcome
    fake.script = answers
    with SyncClient(d.socket) as c:
        src = c.alloc(4096, "src")
        t0 = time.monotonic()
        try:
            c.write("fake", "r", ScatterList.contiguous(64), src=src, timeout=30)
        except ConnectionLost:
            raise AssertionError(f"the daemon dropped its client:\n{d.log_tail()}") from None
        except P2PXferError as exc:
            # A named refusal, not a crash dressed as "internal".
            assert getattr(exc, "code", "") != "internal", exc
        assert time.monotonic() - t0 < 30
        c.free(src)


def test_the_dialing_daemon_still_serves(dialer: tuple[DaemonProc, FakePeer]) -> None:
    d, _ = dialer
    _status_ok(d)
    log = Path(d.log).read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
