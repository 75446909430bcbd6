"""Mutual TLS 1.3 on the control port (issue 14, item 1), and ``p2pxfer certs``.

Certificates come from the CLI (``p2pxfer certs init|issue``, run through
click); daemons run as ``p2pxfer daemon`` subprocesses on 127.0.0.1 with
``tls_ca`` / ``tls_cert`` / ``tls_key``. The raw tests speak TLS (or plain
TCP, or garbage) to a daemon's control port by hand with Python's ``ssl``,
as an attacker on the network would, and check that the daemon serves on.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import ssl
import stat
import subprocess
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from daemon_helpers import LOOPBACK, Agent, DaemonProc, Plan, free_port, start_daemon, wait_for
from p2pxfer import certs
from p2pxfer.bench._server import TLS_ENV, resolve_region
from p2pxfer.cli import main
from p2pxfer.client import connect
from p2pxfer.daemon import Daemon, DaemonConfig
from p2pxfer.daemon._daemon import check_exposure, credentials
from p2pxfer.daemon._tls import load_tls
from p2pxfer.errors import (
    AuthenticationFailed,
    ConfigError,
    ConnectionLost,
    InvalidArgument,
    UnknownRegion,
)
from p2pxfer.protocol import SCHEMA_VERSION, FrameDecoder, encode_frame
from p2pxfer.testing import p2pxfer_cmd, write_config

TOKEN = "tls-and-a-token"
NODES = ("node-a", "node-b", "node-c")


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, ["certs", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cluster CA with node-a, node-b, node-c; another CA with a node-b of
    its own (``other/``)."""
    root = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        r = cli("init", str(root / ca))
        assert r.exit_code == 0, r.output
    for node in NODES:
        r = cli("issue", "--ca", str(root / "ca"), "--name", node, "--host", LOOPBACK,
                "--out", str(root / node))
        assert r.exit_code == 0, r.output
        assert f'tls_cert = "{root / node / node}.crt"' in r.output
    r = cli("issue", "--ca", str(root / "other-ca"), "--name", "node-b", "--out",
            str(root / "other"))
    assert r.exit_code == 0, r.output
    return root


def files(pki: Path, node: str, where: str | None = None) -> dict[str, str]:
    d = pki / (where or node)
    return {"tls_ca": str(d / "ca.crt"), "tls_cert": str(d / f"{node}.crt"),
            "tls_key": str(d / f"{node}.key")}


def creds(pki: Path, node: str, where: str | None = None) -> Any:
    f = files(pki, node, where)
    return load_tls(f["tls_ca"], f["tls_cert"], f["tls_key"])


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    out: list[Any] = []
    yield out
    for p in reversed(out):
        if isinstance(p, Agent):
            p.close()
        else:
            p.stop()


@pytest.fixture(scope="module")
def tls_daemon(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """node-a with TLS only, shared by the raw-socket tests."""
    d = start_daemon(tmp_path_factory.mktemp("d"), "node-a", control_port=free_port(),
                     **files(pki, "node-a"))
    yield d
    d.stop()


def _control(d: DaemonProc) -> tuple[str, int]:
    host, port = d.control.rsplit(":", 1)
    return host, int(port)


def tls_client(d: DaemonProc, ca: str, cert: str, key: str) -> ssl.SSLSocket:
    """A TLS 1.3 connection to ``d``'s control port, its handshake done (in
    TLS 1.3 the client's side finishes before the server checked its cert)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(ca)
    ctx.load_cert_chain(cert, key)
    sock = socket.create_connection(_control(d), timeout=5)
    return ctx.wrap_socket(sock)


def hello_over(sock: socket.socket, name: str) -> dict[str, Any] | None:
    """Say hello; the first frame back, or None when the daemon hung up
    (an alert counts as hanging up)."""
    decoder = FrameDecoder(1 << 20)
    try:
        sock.sendall(encode_frame({"t": "hello", "v": SCHEMA_VERSION, "role": "daemon",
                                   "name": name}, 1 << 20))
        while (frame := decoder.next_frame()) is None:
            data = sock.recv(1 << 16)
            if not data:
                return None
            decoder.feed(data)
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        return None
    finally:
        sock.close()
    return frame


def drain(sock: socket.socket) -> bytes:
    """Everything until the daemon closes (bounded by the socket timeout)."""
    out = b""
    try:
        while data := sock.recv(1 << 16):
            out += data
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return out


def serves(d: DaemonProc, pki: Path) -> None:
    """``d`` is alive and still answers a good TLS caller."""
    assert d.alive(), d.log_tail()
    f = files(pki, "node-b")
    welcome = hello_over(tls_client(d, f["tls_ca"], f["tls_cert"], f["tls_key"]), "node-b")
    assert welcome is not None and welcome["t"] == "welcome", welcome


# -- through real daemons --------------------------------------------------------------

@pytest.mark.parametrize("token", ["", TOKEN], ids=["tls", "tls+token"])
def test_two_tls_daemons_write(pki: Path, tmp_path: Path, procs: list[Any],
                               token: str) -> None:
    """A client writes through two TLS daemons (with or without a token as
    well) and every byte lands; each daemon says which credentials it uses,
    and node-a learnt node-b (its certificate named it) at its address."""
    extra = {"cluster_token": token} if token else {}
    a = start_daemon(tmp_path, "node-a", control_port=free_port(), **files(pki, "node-a"),
                     **extra)
    procs.append(a)
    b = start_daemon(tmp_path, "node-b", control_port=free_port(), **files(pki, "node-b"),
                     peers=[{"name": "node-a", "address": a.control}], **extra)
    procs.append(b)
    plan = Plan(0x715, pieces=64, min_len=1 << 10, max_len=8 << 10, region=2 << 20)
    target = Agent("trio", a.socket, "target")
    procs.append(target)
    assert target.ok("export", "r", plan.region) == plan.region
    writer = Agent("trio", b.socket, "writer")
    procs.append(writer)
    pieces = writer.ok("write", "node-a", "r", plan, 1)
    assert target.call("verify", "r", plan, 1, pieces)[0] == "ok"
    st = a.status()
    assert st["credentials"] == ("tls+token" if token else "tls")
    assert st["security"] == ("mutual TLS + cluster token" if token else "mutual TLS")
    assert "node-b" in {p["name"] for p in st["peers"]}
    assert "daemon.open" not in a.log.read_text()


def test_peer_whose_certificate_names_another_node_is_refused(
        pki: Path, tmp_path: Path, procs: list[Any]) -> None:
    """node-b is told node-a lives where node-c (a good certificate of the
    cluster, for node-c) answers: the write fails ``auth_failed`` naming
    what the certificate says, and node-c serves on."""
    c = start_daemon(tmp_path, "node-c", control_port=free_port(), **files(pki, "node-c"))
    procs.append(c)
    b = start_daemon(tmp_path, "node-b", control_port=free_port(), **files(pki, "node-b"),
                     peers=[{"name": "node-a", "address": c.control}])
    procs.append(b)
    target = Agent("trio", c.socket, "target")
    procs.append(target)
    plan = Plan(0x716, pieces=4, min_len=1 << 10, max_len=2 << 10, region=1 << 20)
    assert target.ok("export", "r", plan.region) == plan.region
    writer = Agent("trio", b.socket, "writer")
    procs.append(writer)
    reply = writer.call("write", "node-a", "r", plan, 1)
    assert reply[0] == "raised" and reply[2] == "auth_failed", reply
    assert "certificate names ['node-c']" in reply[3], reply
    wait_for(lambda: "peer.auth_failed" in b.log.read_text(), "node-b to log the refusal")
    assert c.alive() and b.alive()


def test_daemon_with_an_expired_certificate_refuses_to_start(pki: Path, tmp_path: Path
                                                              ) -> None:
    cert, key = expired(pki, "node-a", tmp_path)
    cfg = write_config(tmp_path / "old.toml", {
        "node": "node-a", "socket": str(tmp_path / "old.sock"),
        "control": f"{LOOPBACK}:{free_port()}", "fabric_node": LOOPBACK,
        "tls_ca": str(pki / "ca" / "ca.crt"), "tls_cert": str(cert), "tls_key": str(key)})
    run = subprocess.run([*p2pxfer_cmd(), "daemon", "--config", str(cfg)], check=False,
                         capture_output=True, text=True, timeout=60)
    out = run.stdout + run.stderr
    assert run.returncode == 78, out  # a config error: systemd does not restart it
    assert f"tls_cert {cert} expired" in out, out
    assert len(out.strip().splitlines()) == 1, out  # one line, no traceback
    assert not (tmp_path / "old.sock").exists()


# -- by hand, against one TLS daemon -----------------------------------------------------

def test_plain_tcp_hello_gets_nothing(tls_daemon: DaemonProc, pki: Path) -> None:
    sock = socket.create_connection(_control(tls_daemon), timeout=5)
    sock.sendall(encode_frame({"t": "hello", "v": SCHEMA_VERSION, "role": "daemon",
                               "name": "node-b"}, 1 << 20))
    got = drain(sock)
    assert b"welcome" not in got and b"node-a" not in got, got
    serves(tls_daemon, pki)
    wait_for(lambda: "peer.tls_failed" in tls_daemon.log.read_text(),
             "the daemon to log the failed handshake")


def test_garbage_in_the_handshake_closes_only_that_connection(tls_daemon: DaemonProc,
                                                              pki: Path) -> None:
    """A real ClientHello, then garbage where the client's Finished should
    be; meanwhile a silent connection stays open and a good one is served."""
    silent = socket.create_connection(_control(tls_daemon), timeout=5)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    sock = socket.create_connection(_control(tls_daemon), timeout=5)
    sock.sendall(outgoing.read())
    assert sock.recv(1 << 16)  # the ServerHello and the rest of the server's flight
    sock.sendall(b"\x17\x03\x03\x00\x40" + os.urandom(64) + os.urandom(300))
    drain(sock)  # closed (maybe after an alert)
    serves(tls_daemon, pki)
    silent.close()


def test_certificate_from_another_ca_is_refused(tls_daemon: DaemonProc, pki: Path) -> None:
    f = files(pki, "node-b", "other")
    sock = tls_client(tls_daemon, str(pki / "ca" / "ca.crt"), f["tls_cert"], f["tls_key"])
    assert hello_over(sock, "node-b") is None
    # And the other way round: a caller of the other CA refuses the daemon.
    with pytest.raises(AuthenticationFailed, match="certificate refused"):
        trio.run(partial(resolve_region, tls_daemon.control, "r", 10, peer="node-a",
                         tls=creds(pki, "node-b", "other")))
    serves(tls_daemon, pki)


def test_expired_client_certificate_is_refused(tls_daemon: DaemonProc, pki: Path,
                                               tmp_path: Path) -> None:
    cert, key = expired(pki, "node-b", tmp_path)
    sock = tls_client(tls_daemon, str(pki / "ca" / "ca.crt"), str(cert), str(key))
    assert hello_over(sock, "node-b") is None
    serves(tls_daemon, pki)


def test_hello_must_carry_the_certificates_name(tls_daemon: DaemonProc, pki: Path) -> None:
    f = files(pki, "node-c")
    reply = hello_over(tls_client(tls_daemon, **_kw(f)), "node-b")
    assert reply is not None and reply["t"] == "error" and reply["code"] == "auth_failed"
    assert "certificate names ['node-c']" in reply["message"], reply
    reply = hello_over(tls_client(tls_daemon, **_kw(f)), "node-c")
    assert reply is not None and reply["t"] == "welcome" and reply["node"] == "node-a"


def test_bench_resolves_over_tls(tls_daemon: DaemonProc, pki: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --via-daemon``'s question, with the TLS files from the
    environment; a caller dialling the wrong node name is refused."""
    for key, path in zip(TLS_ENV, files(pki, "node-b").values(), strict=True):
        monkeypatch.setenv(key, path)

    async def ask() -> None:
        async with connect(tls_daemon.socket) as client:
            await client.export("bench-r", await client.alloc(1 << 16))
            desc = await resolve_region(tls_daemon.control, "bench-r", 10, peer="node-a")
            assert desc.node == "node-a" and desc.length == 1 << 16
            with pytest.raises(UnknownRegion):
                await resolve_region(tls_daemon.control, "nope", 10, peer="node-a")
            with pytest.raises(AuthenticationFailed, match="certificate names"):
                await resolve_region(tls_daemon.control, "bench-r", 10, peer="node-x")

    trio.run(ask)
    monkeypatch.delenv(TLS_ENV[2])
    with pytest.raises(ConfigError, match="P2PXFER_TLS_KEY"):
        trio.run(partial(resolve_region, tls_daemon.control, "r", 10))
    serves(tls_daemon, pki)


def _kw(f: dict[str, str]) -> dict[str, str]:
    return {"ca": f["tls_ca"], "cert": f["tls_cert"], "key": f["tls_key"]}


def expired(pki: Path, node: str, out: Path) -> tuple[Path, Path]:
    """A certificate of the cluster CA for ``node`` that expired yesterday."""
    ca_cert = x509.load_pem_x509_certificate((pki / "ca" / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca" / "ca.key").read_bytes(), None)
    now = dt.datetime.now(dt.UTC)
    cert, key = certs.make_node_cert(ca_cert, ca_key, node, [LOOPBACK],  # type: ignore[arg-type]
                                     not_before=now - dt.timedelta(days=30),
                                     not_after=now - dt.timedelta(days=1))
    cert_path, key_path = out / f"{node}-expired.crt", out / f"{node}-expired.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


# -- in process: control ports only -----------------------------------------------------

def test_in_process_peer_link_over_tls(pki: Path) -> None:
    """Two daemons' control ports (no engine): node-a's link to node-b runs
    over TLS, node-b learns node-a; a link to node-b that finds node-c there
    is refused before anything is asked."""
    engine: Any = SimpleNamespace(config=SimpleNamespace(incarnation=1))

    def daemon(node: str) -> Daemon:
        return Daemon(DaemonConfig(node=node, control=f"{LOOPBACK}:0",
                                   **files(pki, node)), engine)

    async def run() -> None:
        a, b, c = daemon("node-a"), daemon("node-b"), daemon("node-c")
        async with trio.open_nursery() as nursery:
            for d in (a, b, c):
                d.nursery = nursery
                await d.serve_peers(nursery)
            a.peers.add("node-b", b.control_address)
            with trio.fail_after(10):
                peers = (await a.peers.request("node-b", "peers"))["peers"]
                assert [p["name"] for p in peers] == ["node-a"]
                a.peers.add("node-b", c.control_address)
                with pytest.raises(AuthenticationFailed, match="certificate names"):
                    await a.peers.request("node-b", "peers")
                assert a.peers.link("node-b").state()["state"] == "auth failed"
            nursery.cancel_scope.cancel()

    trio.run(run)


def test_in_process_caps_and_deadline_hold_before_the_handshake(
        pki: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection caps refuse a TLS caller before any handshake, and a
    caller that never finishes one is cut off at AUTH_TIMEOUT_S; a good
    caller is served once a slot is free."""
    from p2pxfer.daemon import _auth as auth_mod
    from p2pxfer.daemon._dial import dial_peer

    # Long enough that a starved test still refuses the third caller while
    # the two silent ones hold their slots.
    auth_s = 3.0
    monkeypatch.setattr(auth_mod, "AUTH_TIMEOUT_S", auth_s)
    engine: Any = SimpleNamespace(config=SimpleNamespace(incarnation=1))
    # The cap per address: one that closes the oldest pending connection to
    # make room (max_pending_*) would let this caller in.
    a = Daemon(DaemonConfig(node="node-a", control=f"{LOOPBACK}:0", max_connections_per_host=2,
                            **files(pki, "node-a")), engine)
    b_creds = creds(pki, "node-b")

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            a.nursery = nursery
            await a.serve_peers(nursery)
            host, port = a.control_address.rsplit(":", 1)
            t0 = trio.current_time()  # before the daemon accepts them
            silent = [await trio.open_tcp_stream(host, int(port)) for _ in range(2)]
            with trio.fail_after(20):
                while sum(a.control_connections.values()) < 2:
                    await trio.sleep(0.01)
                with pytest.raises(ConnectionLost, match="closed during the TLS handshake"):
                    await dial_peer(a.control_address, name="node-b", expect="node-a",
                                    tls=b_creds)
                for s in silent:  # the daemon hangs up on both at the deadline
                    assert await s.receive_some(1 << 10) == b""
                    await s.aclose()
                assert auth_s <= trio.current_time() - t0 < auth_s + 5
                pump = await dial_peer(a.control_address, name="node-b", expect="node-a",
                                       tls=b_creds)
                assert (await pump.request("peers"))["peers"] == []
                await pump.aclose()
            nursery.cancel_scope.cancel()

    trio.run(run)


# -- configuration -----------------------------------------------------------------------

def test_tls_config(pki: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"go together.*missing: tls_ca, tls_key"):
        DaemonConfig.from_dict({"tls_cert": "x.crt"})
    with pytest.raises(ConfigError, match="tls_key must be a string"):
        DaemonConfig.from_dict({"tls_key": 1})
    exposed = {"node": "node-a", "control": "0.0.0.0:0", "fabric_node": LOOPBACK}
    cfg = DaemonConfig.from_dict({**exposed, **files(pki, "node-a")})
    assert check_exposure(cfg) is False  # TLS counts as credentials off loopback
    assert credentials(cfg) == "tls"
    assert credentials(DaemonConfig.from_dict({**exposed, "cluster_token": TOKEN})) == "token"
    with pytest.raises(InvalidArgument, match="tls_cert"):
        check_exposure(DaemonConfig.from_dict(exposed))


@pytest.mark.parametrize("case", ["missing", "not-pem", "wrong-key", "other-ca", "other-node"])
def test_bad_tls_files_named(pki: Path, tmp_path: Path, case: str) -> None:
    f = files(pki, "node-a")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    node = "node-a"
    if case == "missing":
        f["tls_key"], want = str(tmp_path / "nope.key"), f"tls_key {tmp_path / 'nope.key'} does"
    elif case == "not-pem":
        f["tls_cert"], want = str(garbage), f"tls_cert {garbage} is not a PEM certificate"
    elif case == "wrong-key":
        f["tls_key"] = files(pki, "node-b")["tls_key"]
        want = "is not the key of tls_cert"
    elif case == "other-ca":
        f["tls_ca"], want = str(pki / "other-ca" / "ca.crt"), "is not signed by the CA"
    else:
        node, want = "node-b", "not this node 'node-b'"
    with pytest.raises(ConfigError) as err:
        load_tls(f["tls_ca"], f["tls_cert"], f["tls_key"], node=node)
    assert want in str(err.value)


def test_ca_bundle_with_two_cas_trusts_both(pki: Path, tmp_path: Path) -> None:
    """While one CA replaces another, tls_ca holds both."""
    bundle = tmp_path / "both.crt"
    bundle.write_bytes((pki / "ca" / "ca.crt").read_bytes()
                       + (pki / "other-ca" / "ca.crt").read_bytes())
    f = files(pki, "node-b", "other")
    assert load_tls(str(bundle), f["tls_cert"], f["tls_key"], node="node-b").name == "node-b"


# -- the certs command line ----------------------------------------------------------------

def test_certs_cli(tmp_path: Path) -> None:
    ca, out = tmp_path / "ca", tmp_path / "out"
    r = cli("issue", "--ca", str(ca), "--name", "n1", "--out", str(out))
    assert r.exit_code == 1 and "no CA in" in r.output and "certs init" in r.output, r.output
    assert cli("init", str(ca)).exit_code == 0
    assert stat.S_IMODE((ca / "ca.key").stat().st_mode) == 0o600
    r = cli("init", str(ca))
    assert r.exit_code == 1 and "not overwriting" in r.output, r.output
    before = (ca / "ca.crt").read_bytes()
    assert cli("init", str(ca), "--force").exit_code == 0
    assert (ca / "ca.crt").read_bytes() != before

    r = cli("issue", "--ca", str(ca), "--name", "n1", "--host", LOOPBACK, "--host", "::1",
            "--out", str(out))
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE((out / "n1.key").stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate((out / "n1.crt").read_bytes())
    assert certs.cert_names(cert) == ("n1",)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {o.dotted_string for o in eku} == {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}
    assert (out / "ca.crt").read_bytes() == (ca / "ca.crt").read_bytes()
    load_tls(str(out / "ca.crt"), str(out / "n1.crt"), str(out / "n1.key"), node="n1")

    r = cli("issue", "--ca", str(ca), "--name", "n1", "--out", str(out))
    assert r.exit_code == 1 and "not overwriting" in r.output, r.output
    assert cli("issue", "--ca", str(ca), "--name", "n1", "--out", str(out),
               "--force").exit_code == 0
    for bad, said in ((["--host", "example.com"], "--host takes IP addresses"),
                      (["--name", "no spaces"], "cannot be a certificate's DNS name"),
                      (["--days", "4000"], "would outlive the CA")):
        args = ["--ca", str(ca), "--name", "n2", "--out", str(out), *bad]
        r = cli("issue", *args)
        assert r.exit_code == 1 and said in r.output, r.output
    (ca / "ca.key").unlink()
    (ca / "ca.key").mkdir()  # unreadable as a key, even for root
    r = cli("issue", "--ca", str(ca), "--name", "n3", "--out", str(out))
    assert r.exit_code == 1 and f"cannot read CA key {ca / 'ca.key'}" in r.output, r.output
    (ca / "ca.key").rmdir()
    (ca / "ca.key").write_text("garbage")
    r = cli("issue", "--ca", str(ca), "--name", "n3", "--out", str(out))
    assert r.exit_code == 1 and "is not a PEM private key" in r.output, r.output
    assert not (out / "n3.crt").exists()
