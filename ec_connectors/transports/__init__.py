"""Transports: one small interface (base.Transport), several small backends."""

from __future__ import annotations

from ec_connectors.config import EPDConfig
from ec_connectors.transports.base import Placement, Transport


def make_transport(config: EPDConfig, placement: Placement | None = None) -> Transport:
    """The transport `config` names, for a process at `placement` (default: a worker that
    both produces and consumes, e.g. a standalone encoder or a test)."""
    placement = placement or Placement()
    if config.transport == "safetensors":
        from ec_connectors.transports.safetensors_fs import SafetensorsTransport

        return SafetensorsTransport(
            config.storage_path, config.namespace or "default", config.max_storage_bytes,
            fsync=config.fsync, verify_checksum=config.verify_checksum,
        )
    if config.transport == "mooncake":
        if placement.role == "scheduler":
            from ec_connectors.transports.mooncake_catalog import MooncakeCatalog

            return MooncakeCatalog(config, placement)
        from ec_connectors.transports.mooncake_te import MooncakeTransport

        return MooncakeTransport(config, placement)
    raise ValueError(f"unknown transport {config.transport!r}")


__all__ = ["Placement", "Transport", "make_transport"]
