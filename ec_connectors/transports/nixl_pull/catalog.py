"""The scheduler's view of the `nixl` transport: the core's catalog under its name.

NIXL producers announce their items as every peer-pull producer does (peer_pull/announcer.py),
so the view is the core's catalog; this module holds it apart from the workers' modules so the
scheduler imports neither torch nor NIXL.
"""

from __future__ import annotations

from ec_connectors.transports.peer_pull.catalog import PeerCatalog


class NixlCatalog(PeerCatalog):
    """The scheduler-role view for the `nixl` transport (its producers announce alike)."""

    name = "nixl"
