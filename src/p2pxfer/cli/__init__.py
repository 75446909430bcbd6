"""The ``p2pxfer`` command line. Commands only parse options, call the library
and render results (rich); no transfer logic lives here. One module per
command family; this one makes the group."""

from __future__ import annotations

import click

from p2pxfer._certs_cli import certs
from p2pxfer.log import configure

from ._bench import bench
from ._common import DEFAULT_SOCKET, console
from ._daemon import daemon, peers, status
from ._demo import demo
from ._ping import ping
from ._plan import plan

__all__ = ["DEFAULT_SOCKET", "console", "daemon", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="p2pxfer", message="p2pxfer %(version)s")
@click.option("--log-level", default="WARNING", show_default=True, help="structlog level",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                                case_sensitive=False))
def main(log_level: str) -> None:
    """p2pxfer: RDMA writes of scatter lists between machines over libfabric."""
    configure(log_level)


for _command in (demo, daemon, status, peers, ping, plan, bench, certs):
    main.add_command(_command)


if __name__ == "__main__":
    main()
