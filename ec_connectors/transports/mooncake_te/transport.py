"""The `mooncake` transport of a worker: the peer-pull core on a Mooncake data path.

The core (peer_pull/: pool, pins and leases, announcements, the side channel, pulls with
deadlines, retries and verification) with the data path `te_data_path` resolves to, the same
in every process of a deployment (`auto`: socket over TCP with host pools, else engine):
- engine (engine.py): the producer writes the item straight into the consumer's registered
  buffer with the transfer engine (RDMA or TCP), into the range the consumer proved.
- socket (socket_path.py): the consumer reads each item from a warm data connection of its
  own to the producer's stream port; no engine is started (`needs_engine`), and large host
  items are sent from where they lie.

Routing, retries across tiers and request lifecycle live above (ec_connectors/workers/,
scheduler_hooks/).
"""

from __future__ import annotations

from ec_connectors.config import EPDConfig
from ec_connectors.transports.base import Placement
from ec_connectors.transports.mooncake_te.engine import EnginePath, needs_engine
from ec_connectors.transports.mooncake_te.socket_path import SocketPath
from ec_connectors.transports.peer_pull.transport import PeerPullTransport, peer_host


class MooncakeTransport(PeerPullTransport):
    """Worker-role `mooncake` transport (see the module docstring). One per worker process."""

    name = "mooncake"

    def __init__(self, config: EPDConfig, placement: Placement) -> None:
        host = peer_host(config)
        # the engine only where items move through it: on the socket path its listeners
        # would bind every interface for nothing
        path = EnginePath(config, host) if needs_engine(config) else SocketPath(config)
        super().__init__(config, placement, path, host)
