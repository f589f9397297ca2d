"""Publish finished embeddings through the project's transport.

Publishing finished embeddings through the project's transport (EPDConnector's), under
the item id a vLLM consumer will look up, and the `ec_transfer_params` a gateway forwards."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from ec_connectors.config import EPDConfig
from ec_connectors.protocol.params import ItemEntry, TransferParams
from ec_connectors.protocol.stored import ItemInfo
from ec_connectors.transports import make_transport
from epd_common.lru import BoundedLRU

MAX_REMEMBERED = 65536


class Publisher:
    """Store embeddings through the transport, off the event loop.

    `put`s embeddings off the event loop (blocking I/O on its own threads); an item already
    published and still stored is not written twice."""

    def __init__(self, config: EPDConfig, engine_id: str, threads: int = 2) -> None:
        self.config = config
        self.engine_id = engine_id
        self.namespace = config.namespace or "default"
        self.transport = make_transport(config)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="epd-publish")
        self._known: BoundedLRU[str, ItemInfo] = BoundedLRU(MAX_REMEMBERED)
        self.published = 0
        self.published_bytes = 0

    def _put(self, item_id: str, tensor: torch.Tensor) -> ItemInfo:
        info = self.stored(item_id)
        if info is not None:
            return info
        info = self.transport.put(item_id, tensor)
        self.published += 1
        self.published_bytes += info.nbytes
        self._known[item_id] = info
        return info

    def stored(self, item_id: str) -> ItemInfo | None:
        """What this pool published under an item id, if still stored.

        What this pool published under `item_id`, if the transport still holds it
        (blocking: may touch the medium)."""
        info = self._known.get(item_id)
        return info if info is not None and self.transport.exists(item_id) else None

    async def publish(self, item_id: str, tensor: torch.Tensor) -> ItemInfo:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._put, item_id, tensor)

    def params(self, infos: dict[str, ItemInfo]) -> TransferParams:
        """Build the `ec_transfer_params` for a request's published items.

        `ec_transfer_params` for a request whose items are `infos` (what a vLLM producer
        with EPDConnector returns)."""
        endpoint = self.transport.endpoint  # peer transports: consumers pull from here
        items = {item_id: ItemEntry.describe(item_id, info.shape[0], info,
                                             with_location=bool(endpoint))
                 for item_id, info in infos.items()}
        return TransferParams(transport=self.transport.name, namespace=self.namespace,
                              producer=self.engine_id, items=items, endpoint=endpoint)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.transport.close()
