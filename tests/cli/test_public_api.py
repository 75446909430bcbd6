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
    "TransferAborted", "TransferTimeout",
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
               "TransferAborted", "TransferTimeout")]
    assert errors
    for cls in errors:
        assert issubclass(cls, p2pxfer.P2PXferError), cls


def test_package_ships_py_typed() -> None:
    from importlib.resources import files

    assert files("p2pxfer").joinpath("py.typed").is_file()
