"""Transports: one small interface (base.Transport), several small backends."""

from __future__ import annotations

from ec_connectors.config import EPDConfig
from ec_connectors.transports.base import Transport


def make_transport(config: EPDConfig) -> Transport:
    if config.transport == "safetensors":
        from ec_connectors.transports.safetensors_fs import SafetensorsTransport

        return SafetensorsTransport(
            config.storage_path, config.namespace or "default", config.max_storage_bytes,
            fsync=config.fsync, verify_checksum=config.verify_checksum,
        )
    raise ValueError(f"unknown transport {config.transport!r}")


__all__ = ["Transport", "make_transport"]
