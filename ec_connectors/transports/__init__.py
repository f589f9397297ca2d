"""Transports: how item bytes move between producers and consumers.

Transports: one small interface (base.Transport), several small backends, and tiers
(tiered.TieredTransport) that put several of them behind one. `make_transport` builds the one
a config names.

- base.py: the Transport interface, Placement (which process asks), events, tensor helpers;
- safetensors_fs.py: the shared-directory backend, one safetensors file per item;
- shm/: the same-host shared-memory backend (its own map);
- peer_pull/: the peer-pull core both peer transports share: consumers pull items out of
  producers' pools, the data path given to it (its map);
- mooncake_te/: the Mooncake Transfer Engine backend: the core with the engine's writes or a
  socket stream as its data path (its map);
- nixl_pull/: NIXL reads out of producers' registered pools: the core with NIXL (its map);
- mooncake_store/: the Mooncake Store backend, a distributed store (its map);
- tiered.py: TieredTransport, several backends behind one (save to all, load in order);
- leases.py: the lease book, the one keep/evict policy of the stores that hold items for
  consumers (shm's arena, peer_pull's producer pool): leases, victims, backpressure;
- hashed_copy.py: an item copied and hashed in one pass on several threads (torch-free):
  shm's keyed digests and the peer transports' checksum (peer_pull/);
- memory.py: a registered memory pool (Allocator, MemoryPool, PoolBuffer) for the Mooncake
  backends, and the allocator shm's arena carves its blocks with;
- dir_watch.py: inotify over a directory's keys, for the file-backed backends (KeyWatch);
- engine_ports.py: the port range a process's Mooncake engine may listen on (the port plan).
Backends are imported only when named: most of them need torch, this package does not.
"""

from __future__ import annotations

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.protocol.stored import TRANSPORT_NAMES
from ec_connectors.transports.base import Placement, Transport

logger = get_logger(__name__)


def _make_one(name: str, config: EPDConfig, placement: Placement) -> Transport:
    if name == "safetensors":
        from ec_connectors.transports.safetensors_fs import SafetensorsTransport

        return SafetensorsTransport(
            config.storage_path, config.namespace or "default", config.max_storage_bytes,
            fsync=config.fsync, verify_checksum=config.verify_checksum, seal=config.seal,
            model=config.model_fingerprint or "",
        )
    if name == "mooncake":
        if placement.role == "scheduler":
            from ec_connectors.transports.mooncake_te.catalog import MooncakeCatalog

            return MooncakeCatalog(config, placement)
        from ec_connectors.transports.mooncake_te.transport import MooncakeTransport

        return MooncakeTransport(config, placement)
    if name == "nixl":
        if placement.role == "scheduler":
            from ec_connectors.transports.nixl_pull.catalog import NixlCatalog

            return NixlCatalog(config, placement)
        from ec_connectors.transports.nixl_pull.transport import NixlTransport

        return NixlTransport(config, placement)
    if name == "mooncake_store":
        from ec_connectors.transports.mooncake_store import MooncakeStoreTransport

        return MooncakeStoreTransport(config, placement)
    if name == "shm":
        from ec_connectors.transports.shm.transport import ShmTransport

        return ShmTransport(config, placement)
    raise ValueError(f"unknown transport {name!r} (known: {', '.join(TRANSPORT_NAMES)})")


def make_transport(config: EPDConfig, placement: Placement | None = None) -> Transport:
    """Build the transport (or tiers) a config names, for one process.

    The transport `config` names, for a process at `placement` (default: a worker that
    both produces and consumes, e.g. a standalone encoder or a test). With several tiers,
    a tier that cannot start (e.g. no store master) is left out with an error in the log;
    the deployment runs on the others. A single transport that cannot start raises."""
    placement = placement or Placement()
    names = config.tiers
    if len(names) == 1:
        return _make_one(names[0], config, placement)
    from ec_connectors.transports.tiered import TieredTransport

    tiers: list[Transport] = []
    for name in names:
        try:
            tiers.append(_make_one(name, config, placement))
        except (RuntimeError, OSError) as exc:
            logger.error("EPD: tier %s is disabled for this process: %s", name, exc)
    if not tiers:
        raise RuntimeError(f"none of the transport tiers {names} could start; see the log")
    return TieredTransport(tiers)


__all__ = ["Placement", "Transport", "make_transport"]
