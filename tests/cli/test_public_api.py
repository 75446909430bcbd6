"""The public surface is deliberate: adding or removing a name is a decision."""

import p2pxfer

EXPECTED = {
    "BlockingEngine", "Client", "DaemonError", "DescriptorError", "Engine", "EngineClosed",
    "EngineConfig",
    "FabricError", "InvalidArgument", "LocalRegion", "MemberUpdate", "P2PXferError",
    "PeerLost", "ProviderNotFound",
    "ReadOnlyBuffer", "RegionDescriptor", "RegistrationCache", "RegistrationError",
    "RemoteClosed", "ScatterError", "ScatterList", "SharedBuffer", "SharedMemory",
    "SyncClient", "TransferError", "UnregisteredMemory", "WaitTimeout",
    "ConnectionLost", "NotificationUnknown", "PeerUnreachable", "RailsExhausted",
    "TransferAborted", "TransferTimeout", "RegionWithdrawn",
    "alloc_shared", "connect", "open_engine",
}


def test_public_names_are_pinned() -> None:
    assert set(p2pxfer.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(p2pxfer, name) is not None


def test_every_error_is_a_p2pxfer_error() -> None:
    errors = [getattr(p2pxfer, n) for n in EXPECTED if n.endswith("Error") or n in
              ("EngineClosed", "ProviderNotFound", "ReadOnlyBuffer", "RemoteClosed",
               "UnregisteredMemory", "WaitTimeout", "InvalidArgument", "ConnectionLost",
               "NotificationUnknown", "PeerUnreachable", "RailsExhausted",
               "TransferAborted", "TransferTimeout", "RegionWithdrawn")]
    assert errors
    for cls in errors:
        assert issubclass(cls, p2pxfer.P2PXferError), cls


def test_package_ships_py_typed() -> None:
    from importlib.resources import files

    assert files("p2pxfer").joinpath("py.typed").is_file()


def _in_child(code: str) -> tuple[str, str]:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("FI_")}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), out.stderr


def test_the_client_library_loads_no_fabric() -> None:
    """A program that only talks to a daemon loads no libfabric (nor the
    providers and signal handlers it drags in), sets none of its variables and
    leaves structlog to the application; the engine's names still work, loaded
    when first used."""
    got, _ = _in_child(
        "import os, sys, structlog, p2pxfer, p2pxfer.client\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('libfabric' in maps, 'p2pxfer._fabric' in sys.modules,\n"
        "      'FI_AV_REMOVE_CLEANUP' in os.environ, structlog.is_configured())\n"
        "p2pxfer.Engine\n"
        "print('libfabric' in open('/proc/self/maps').read())\n")
    assert got.splitlines() == ["False False False False", "True"], got


def test_library_events_go_to_stderr_until_the_application_configures_structlog() -> None:
    got, err = _in_child(
        "import sys, structlog\n"
        "from p2pxfer.log import get_logger\n"
        "log = get_logger('p2pxfer.test')\n"
        "log.info('quiet.info')\n"
        "log.warning('loud.warning', n=1)\n"
        "sys.stderr.flush()\n"
        "structlog.configure(processors=[structlog.processors.KeyValueRenderer()],\n"
        "                    logger_factory=structlog.PrintLoggerFactory(sys.stdout))\n"
        "log.info('app.info')\n")
    # Nothing of ours on stdout before; the application's own config after.
    assert got == "event='app.info'", got
    assert "loud.warning" in err and "quiet.info" not in err, err
