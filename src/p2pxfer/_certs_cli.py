"""``p2pxfer certs init|issue``: the command line over ``p2pxfer.certs``
(registered in ``p2pxfer.cli``). Options are parsed and results printed here;
certificates are made in ``p2pxfer.certs``."""

from __future__ import annotations

import click

from p2pxfer.errors import P2PXferError

__all__ = ["certs"]


@click.group()
def certs() -> None:
    """Credentials for mutual TLS on the control port: a cluster CA and node
    certificates signed by it (see docs/security.md)."""


@certs.command("init")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--days", default=3650, show_default=True, help="validity of the CA")
@click.option("--force", is_flag=True, help="replace an existing CA (every node "
              "certificate it signed stops being trusted once daemons load the new one)")
def init_command(directory: str, days: int, force: bool) -> None:
    """Make the cluster CA in DIRECTORY: ca.crt and ca.key (mode 0600; keep it
    off the nodes)."""
    from p2pxfer import certs as _certs

    try:
        path = _certs.init(directory, days=days, force=force)
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"CA certificate: {path}\nCA key: {path.with_name(_certs.CA_KEY)}")


@certs.command("issue")
@click.option("--ca", "ca_dir", required=True, type=click.Path(file_okay=False),
              help="directory of the CA (from `p2pxfer certs init`)")
@click.option("--name", required=True, help="the node's name (its config's `node`)")
@click.option("--host", "hosts", multiple=True, metavar="IP",
              help="an IP address of the node, added to the certificate; repeatable")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="directory to write NAME.crt, NAME.key and ca.crt into")
@click.option("--days", default=365, show_default=True, help="validity of the certificate")
@click.option("--force", is_flag=True, help="replace existing files")
def issue_command(ca_dir: str, name: str, hosts: tuple[str, ...], out_dir: str, days: int,
                  force: bool) -> None:
    """Issue a node certificate signed by the cluster CA (both server and
    client use: every daemon answers and dials)."""
    from p2pxfer import certs as _certs

    try:
        cert, key = _certs.issue(ca_dir, name, hosts, out_dir, days=days, force=force)
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"tls_cert = \"{cert}\"\ntls_key = \"{key}\"\n"
               f"tls_ca = \"{cert.with_name(_certs.CA_CERT)}\"")
