"""``p2pxfer daemon``, ``status`` and ``peers``: starting a node daemon and
asking a running one what it holds."""

from __future__ import annotations

from functools import partial

import click

from p2pxfer.errors import ConfigError, P2PXferError, ProviderNotFound
from p2pxfer.log import configure

from ._common import DEFAULT_SOCKET, ConfigFailure, client_call, console

__all__ = ["daemon", "peers", "status"]


def _peer_flag(ctx: click.Context, param: click.Parameter,
               value: tuple[str, ...]) -> tuple[object, ...]:
    from p2pxfer.daemon._config import parse_peer

    try:
        return tuple(parse_peer(v) for v in value)
    except P2PXferError as exc:  # a wrong configuration, given as a flag: 78 too
        raise ConfigFailure(f"--peer: {exc}") from exc


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="TOML config (see deploy/p2pxfer.toml for every option)")
@click.option("--node", help="this node's name (config: node)")
@click.option("--socket", "socket_path", help="unix socket for clients (config: socket)")
@click.option("--control", metavar="HOST:PORT", help="control listener (config: control)")
@click.option("--peer", "peer_list", metavar="NAME=HOST:PORT", multiple=True,
              callback=_peer_flag, help="a peer daemon's control address; repeatable "
              "(added to the config's peers)")
@click.option("--provider", help="libfabric provider (config: provider)")
@click.option("--fabric-node", help="local address the fabric binds to (config: fabric_node)")
@click.option("--fabric-ports", metavar="LOW-HIGH",
              help="TCP ports the fabric listens on, one per rail, e.g. 7500-7531 "
                   "(config: fabric_ports; default: ephemeral)")
@click.option("--token-file", type=click.Path(dir_okay=False),
              help="file holding the cluster token (config: cluster_token_file)")
@click.option("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics (config: metrics)")
@click.option("--log-format", type=click.Choice(["console", "json"]),
              help="log lines as text or JSON (config: log_format)")
@click.option("--debug", is_flag=True, help="on a startup failure, show the traceback")
def daemon(config_path: str | None, node: str | None, socket_path: str | None,
           control: str | None, peer_list: tuple[object, ...], provider: str | None,
           fabric_node: str | None, fabric_ports: str | None, token_file: str | None,
           metrics: str | None, log_format: str | None, debug: bool) -> None:
    """Run the node daemon in the foreground until interrupted (SIGINT, SIGTERM).

    \b
    Flags override the config file; without --config the defaults apply:
      p2pxfer daemon --node a --socket /tmp/a.sock --control 127.0.0.1:7700 \\
          --fabric-node 127.0.0.1 --peer b=127.0.0.1:7701
    """
    import faulthandler

    import trio

    from p2pxfer._startup import check_startup, leaves, one_line
    from p2pxfer.daemon import DaemonConfig, serve

    flags = {"node": node, "socket": socket_path, "control": control, "provider": provider,
             "fabric_node": fabric_node, "fabric_ports": fabric_ports,
             "cluster_token_file": token_file,
             "metrics": metrics, "log_format": log_format}
    overrides: dict[str, object] = {k: v for k, v in flags.items() if v is not None}
    if peer_list:
        overrides["peers"] = list(peer_list)
    try:
        cfg = DaemonConfig.load(config_path, **overrides)
        configure(cfg.log_level, json=cfg.log_format == "json")
        check_startup(cfg)
    except P2PXferError as exc:
        if debug:
            raise
        if isinstance(exc, ConfigError | ProviderNotFound):
            raise ConfigFailure(str(exc)) from None
        raise click.ClickException(str(exc)) from None
    # A crash in the native layer says where (every thread's stack, on
    # stderr: the daemon's log) instead of ending with a bare signal.
    faulthandler.enable()
    try:
        trio.run(partial(serve, cfg, handle_signals=True, process_exits=True))
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # the edge: everything becomes one line (or a traceback)
        if debug:
            raise
        if any(isinstance(leaf, ConfigError | ProviderNotFound) for leaf in leaves(exc)):
            # A provider or address this machine does not have is the config's
            # fault too: restarting cannot fix it.
            raise ConfigFailure(one_line(exc, cfg)) from None
        raise click.ClickException(one_line(exc, cfg)) from None


@click.command()
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of tables")
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=0.0,
              metavar="SECONDS",
              help="wait up to SECONDS for a daemon that is still starting to answer")
@click.option("--quiet", "-q", is_flag=True, help="print nothing: the exit status says it all")
def status(socket_path: str, as_json: bool, wait_s: float, quiet: bool) -> None:
    """Regions, peers, transfers in flight and bytes per NIC of a running daemon.
    With --wait, also the way to wait for a daemon started in the background
    (exit status 0 once it answers, 1 if it did not in time)."""
    import json

    from p2pxfer._views import print_status

    st = client_call(socket_path, "status", wait_s)
    assert isinstance(st, dict)
    if quiet:
        return
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    print_status(console, st)


@click.command()
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def peers(socket_path: str, as_json: bool) -> None:
    """Peers the daemon knows (with membership: every member, its state,
    incarnation, address and when it was last heard)."""
    import json

    from p2pxfer._views import merge_links, print_peers

    result = client_call(socket_path, "peers")
    assert isinstance(result, list)
    if as_json:  # the daemon's reply as it is (status --json has the links too)
        click.echo(json.dumps(result, indent=2))
        return
    if not any("state" in p for p in result):  # static peers: add their links' state
        st = client_call(socket_path, "status")
        assert isinstance(st, dict)
        result = merge_links(result, st.get("links", []))
    print_peers(console, result)


