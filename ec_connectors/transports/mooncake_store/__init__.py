"""Mooncake Store transport: embeddings in a distributed store.

Mooncake Store transport: embeddings in a distributed store (a master plus memory segments its
clients contribute), so any instance can fetch what another instance encoded.

- objects.py: an item's store key and object format (header + payload).
- client.py: one store client: bounded setup, calls with deadlines and retries, master health.
- probes.py: the scheduler's non-blocking existence answers (cache + batched background asks).
- transport.py: MooncakeStoreTransport, the Transport built from the above.
"""

from __future__ import annotations

from ec_connectors.transports.mooncake_store.transport import MooncakeStoreTransport

__all__ = ["MooncakeStoreTransport"]
