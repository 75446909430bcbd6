"""What the command modules share: the console, the default socket, size
parsing, and the exit codes (78 for a wrong configuration)."""

from __future__ import annotations

import click
from rich.console import Console

from p2pxfer.errors import InvalidArgument, P2PXferError

__all__ = ["DEFAULT_SOCKET", "EX_CONFIG", "ConfigFailure", "client_call", "console",
           "parse_size_flag"]

DEFAULT_SOCKET = "/run/p2pxfer/p2pxfer.sock"
#: sysexits.h EX_CONFIG: what README and the systemd unit promise for a wrong config
EX_CONFIG = 78

console = Console()


def parse_size_flag(text: str) -> int:
    from p2pxfer.address import parse_size

    try:
        return parse_size(text)
    except InvalidArgument as exc:
        raise click.BadParameter(str(exc)) from None


class ConfigFailure(click.ClickException):
    """A wrong config: exit 78 (EX_CONFIG), which the systemd unit does not
    restart on (a restart cannot fix it)."""

    exit_code = EX_CONFIG


def client_call(socket_path: str, method: str, wait_s: float = 0.0) -> object:
    """``method`` of the daemon at ``socket_path``, or a one-line failure."""
    from p2pxfer.client._sync import call_daemon

    try:
        return call_daemon(socket_path, method, wait_s)
    except P2PXferError as exc:
        raise click.ClickException(str(exc)) from exc
