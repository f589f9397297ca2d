"""The scheduler's view of the `nixl` transport: the Mooncake TE catalog under its name.

NIXL producers announce their items as Mooncake TE producers do (mooncake_te/announcer.py),
so the view is that catalog's; this module holds it apart from the workers' modules so the
scheduler imports neither torch nor NIXL.
"""

from __future__ import annotations

from ec_connectors.transports.mooncake_te.catalog import MooncakeCatalog


class NixlCatalog(MooncakeCatalog):
    """The same view for the `nixl` transport (its producers announce alike)."""

    name = "nixl"
