"""The peer-pull core's data paths (ec_connectors/transports/peer_pull/data_path.py): each
implementation has every method the core calls on a `DataPath`, and each consumer side every
method the puller calls on a `PeerReader`, so none of them leans on a base class of another
transport package for a missing piece."""

from __future__ import annotations

import inspect

from ec_connectors.transports.mooncake_te.engine import EnginePath
from ec_connectors.transports.mooncake_te.socket_path import SocketPath, SocketReader
from ec_connectors.transports.nixl_pull.link import NixlPeerLink
from ec_connectors.transports.nixl_pull.transport import NixlPath
from ec_connectors.transports.peer_pull.data_path import DataPath, PeerReader
from ec_connectors.transports.peer_pull.link import PeerLink


def _methods(protocol: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(protocol).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


def test_every_data_path_has_the_methods_the_core_calls_with_their_parameters():
    wanted = _methods(DataPath)
    assert {"register", "serve_held", "reader", "hold_in_place"} <= set(wanted)
    for path in (EnginePath, SocketPath, NixlPath):
        for name, signature in wanted.items():
            own = getattr(path, name, None)
            assert own is not None, f"{path.__name__} lacks {name}"
            assert list(inspect.signature(own).parameters) == list(signature.parameters), \
                f"{path.__name__}.{name}"
        assert isinstance(path.messages, tuple)


def test_every_reader_has_what_the_puller_calls():
    for reader in (PeerLink, SocketReader, NixlPeerLink):
        for name, signature in _methods(PeerReader).items():
            own = getattr(reader, name, None)
            assert own is not None, f"{reader.__name__} lacks {name}"
            assert list(inspect.signature(own).parameters) == list(signature.parameters), \
                f"{reader.__name__}.{name}"
        assert isinstance(getattr(reader, "quarantined", None), property)
