"""Certificates for mutual TLS on the daemons' control port: a cluster CA
(``init``), node certificates signed by it (``issue``), and the checks a
daemon runs on its own credentials before it listens (``check_node``).

A node certificate names its node as the one DNS name of its subject
alternative names (IP addresses may join it, for other tools; p2pxfer checks
only the name), carries serverAuth and clientAuth (every daemon both dials
and answers), and is signed directly by the cluster CA. Keys are EC P-256,
written unencrypted with mode 0600; nothing is overwritten without
``force``. Every failure is one ``ConfigError`` naming the file. What must
not live here: ``ssl`` contexts and streams (``p2pxfer.daemon._tls``), or
option parsing (``p2pxfer._certs_cli``).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from p2pxfer.errors import ConfigError

__all__ = ["CA_CERT", "CA_DAYS", "CA_KEY", "NODE_DAYS", "NodeCert", "cert_names", "check_node",
           "init", "issue", "make_node_cert"]

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
CA_DAYS = 3650  # the CA outlives many rounds of node certificates
NODE_DAYS = 365
#: node certificates are valid from a few minutes back: clocks of a cluster
#: are never quite in step
BACKDATE = dt.timedelta(minutes=5)
#: a node name fit to be a certificate's DNS name (node names default to host names)
NODE_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")


@dataclass(frozen=True)
class NodeCert:
    """What a daemon's own certificate says (checked by :func:`check_node`)."""

    names: tuple[str, ...]  # the node names it carries (its DNS names)
    not_after: dt.datetime


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, data: bytes, mode: int, force: bool) -> None:
    """Write ``data`` to ``path`` created with ``mode`` (a replaced file is
    removed first, so a key never sits in a file once made wider)."""
    if force:
        path.unlink(missing_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise ConfigError(f"{path} exists; not overwriting it (--force replaces it)") from None
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _refuse_existing(paths: list[Path], force: bool) -> None:
    """Nothing is written when any target exists (no half-made credentials)."""
    if force:
        return
    if taken := [str(p) for p in paths if p.exists()]:
        verb = "exists" if len(taken) == 1 else "exist"
        raise ConfigError(f"{', '.join(taken)} already {verb}; not overwriting "
                          "(--force replaces it)")


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def _pem_key(path: Path, what: str) -> ec.EllipticCurvePrivateKey:
    data = _read(path, what)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise ConfigError(f"{what} {path} is encrypted; p2pxfer needs an unencrypted key "
                          "(kept mode 0600)") from None
    except ValueError as exc:
        raise ConfigError(f"{what} {path} is not a PEM private key") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{what} {path} is a {type(key).__name__}, not an EC key")
    return key


def _pem_certs(path: Path, what: str) -> list[x509.Certificate]:
    data = _read(path, what)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise ConfigError(f"{what} {path} is not a PEM certificate") from exc
    return certs


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def init(directory: str | Path, *, days: int = CA_DAYS, force: bool = False,
         common_name: str = "p2pxfer cluster CA") -> Path:
    """Make a cluster CA in ``directory`` (created): ``ca.key`` (mode 0600)
    and ``ca.crt``. Returns the certificate's path."""
    if days < 1:
        raise ConfigError(f"days must be >= 1, got {days}")
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {out}: {exc.strerror or exc}") from exc
    key_path, cert_path = out / CA_KEY, out / CA_CERT
    _refuse_existing([key_path, cert_path], force)
    key, now = _key(), _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                           critical=False)
            .sign(key, hashes.SHA256()))
    _write(key_path, key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()), 0o600, force)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644, force)
    return cert_path


def _hosts(hosts: list[str] | tuple[str, ...]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for h in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h.strip("[]"))))
        except ValueError:
            raise ConfigError(f"--host takes IP addresses, got {h!r} (the node's one DNS "
                              "name is its node name: --name)") from None
    return out


def make_node_cert(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, name: str,
                   hosts: list[str] | tuple[str, ...] = (), *,
                   not_before: dt.datetime | None = None,
                   not_after: dt.datetime | None = None, days: int = NODE_DAYS,
                   ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A node certificate for ``name`` signed by the CA, and its new key
    (``not_before``/``not_after`` let tests make expired ones)."""
    if not NODE_NAME.fullmatch(name):
        raise ConfigError(f"node name {name!r} cannot be a certificate's DNS name (letters, "
                          "digits, '.', '-', '_'; starting and ending with a letter or digit)")
    if days < 1:
        raise ConfigError(f"days must be >= 1, got {days}")
    key, now = _key(), _now()
    start = now - BACKDATE if not_before is None else not_before
    end = now + dt.timedelta(days=days) if not_after is None else not_after
    if end > ca_cert.not_valid_after_utc:
        raise ConfigError(f"a certificate valid until {end:%Y-%m-%d} would outlive the CA "
                          f"(it expires on {ca_cert.not_valid_after_utc:%Y-%m-%d}): fewer "
                          "--days, or a new CA (docs/security.md, rotating)")
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder()
            .subject_name(_name(name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name), *_hosts(hosts)]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def issue(ca_dir: str | Path, name: str, hosts: list[str] | tuple[str, ...],
          out_dir: str | Path, *, days: int = NODE_DAYS, force: bool = False
          ) -> tuple[Path, Path]:
    """Issue node ``name``'s certificate from the CA in ``ca_dir``: writes
    ``NAME.crt``, ``NAME.key`` (mode 0600) and a copy of ``ca.crt`` into
    ``out_dir`` (what the node needs: its ``tls_cert``, ``tls_key``,
    ``tls_ca``). Returns (certificate, key) paths."""
    ca = Path(ca_dir)
    if not (ca / CA_CERT).exists():
        raise ConfigError(f"no CA in {ca}: {ca / CA_CERT} does not exist (make one with "
                          f"`p2pxfer certs init {ca}`)")
    ca_certs = _pem_certs(ca / CA_CERT, "CA certificate")
    ca_key = _pem_key(ca / CA_KEY, "CA key")
    ca_cert = ca_certs[0]
    if ca_cert.public_key() != ca_key.public_key():
        raise ConfigError(f"CA key {ca / CA_KEY} is not the key of {ca / CA_CERT}")
    cert, key = make_node_cert(ca_cert, ca_key, name, hosts, days=days)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {out}: {exc.strerror or exc}") from exc
    cert_path, key_path, ca_copy = out / f"{name}.crt", out / f"{name}.key", out / CA_CERT
    ca_pem = _read(ca / CA_CERT, "CA certificate")  # as it is: it may hold several CAs
    copy_ca = not (ca_copy.exists() and ca_copy.read_bytes() == ca_pem)
    _refuse_existing([cert_path, key_path, *([ca_copy] if copy_ca else [])], force)
    _write(key_path, key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()), 0o600, force)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644, force)
    if copy_ca:
        _write(ca_copy, ca_pem, 0o644, force)
    return cert_path, key_path


def cert_names(cert: x509.Certificate) -> tuple[str, ...]:
    """The node names a certificate carries: its DNS names."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(san.get_values_for_type(x509.DNSName))


def check_node(ca: str | Path, cert: str | Path, key: str | Path, *, node: str | None = None
               ) -> NodeCert:
    """Check a daemon's credentials before it uses them: each file readable
    and what it should be, the key the certificate's, the certificate signed
    directly by a CA in ``ca`` (several CAs may sit there while one replaces
    another), valid now, and naming ``node``. ``ConfigError`` naming the
    file (``tls_ca`` / ``tls_cert`` / ``tls_key``) otherwise."""
    ca_path, cert_path, key_path = Path(ca), Path(cert), Path(key)
    cas = _pem_certs(ca_path, "tls_ca")
    if not cas:
        raise ConfigError(f"tls_ca {ca_path} holds no certificate")
    mine = _pem_certs(cert_path, "tls_cert")
    if not mine:
        raise ConfigError(f"tls_cert {cert_path} holds no certificate")
    own = mine[0]
    private = _pem_key(key_path, "tls_key")
    if private.public_key() != own.public_key():
        raise ConfigError(f"tls_key {key_path} is not the key of tls_cert {cert_path}")
    if not any(_issued_by(own, c) for c in cas):
        raise ConfigError(f"tls_cert {cert_path} is not signed by the CA in tls_ca {ca_path}")
    now = _now()
    if own.not_valid_after_utc < now:
        raise ConfigError(f"tls_cert {cert_path} expired on {own.not_valid_after_utc:%Y-%m-%d}"
                          " (issue a new one: p2pxfer certs issue)")
    if own.not_valid_before_utc > now:
        raise ConfigError(f"tls_cert {cert_path} is not valid before "
                          f"{own.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (is the clock right?)")
    names = cert_names(own)
    if node is not None and node not in names:
        raise ConfigError(f"tls_cert {cert_path} names {list(names)}, not this node {node!r} "
                          f"(issue one: p2pxfer certs issue --name {node})")
    return NodeCert(names, own.not_valid_after_utc)


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
