"""The daemon's side of ``fabric_ports``: the range handed to the tcp
provider before the engine opens, and checked once it has (every rail must
listen inside it, or a firewall written for the range would cut it off)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2pxfer.errors import StartupError
from p2pxfer.fabric._ports import (
    ENV_HIGH,
    ENV_LOW,
    listening_port,
    parse_port_range,
    use_port_range,
)

from ._notes import rails

if TYPE_CHECKING:
    from p2pxfer.engine import Engine

    from ._config import DaemonConfig

__all__ = ["apply_fabric_ports", "check_rail_ports"]


def apply_fabric_ports(config: DaemonConfig) -> None:
    """Before any fabric call of this process: listen within the range."""
    if config.fabric_ports:
        use_port_range(*parse_port_range(config.fabric_ports))


def check_rail_ports(config: DaemonConfig, engine: Engine) -> None:
    """``StartupError`` naming the first rail that listens outside the range
    (libfabric had started in this process before the range was set)."""
    if not config.fabric_ports:
        return
    low, high = parse_port_range(config.fabric_ports)
    for rail in rails(engine):
        port = listening_port(rail["address"])
        if port is not None and not low <= port <= high:
            raise StartupError(
                f"rail {rail['nic']} listens on", rail["address"],
                f"outside fabric_ports {config.fabric_ports}: libfabric started in this "
                f"process before the range was set (set {ENV_LOW} and {ENV_HIGH} in its "
                f"environment, or run the daemon as a process of its own)")
