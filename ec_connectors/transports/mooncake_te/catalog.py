"""The scheduler's and gateway's view of the `mooncake` transport (torch-free).

The core's catalog (peer_pull/catalog.py: producers' announcements, `locate`, `list_keys`)
under this transport's name; the gateway's availability imports it from here."""

from __future__ import annotations

from ec_connectors.transports.peer_pull.catalog import PeerCatalog


class MooncakeCatalog(PeerCatalog):
    """Scheduler-role view of the mooncake transport: which items producers hold, and where."""

    name = "mooncake"
