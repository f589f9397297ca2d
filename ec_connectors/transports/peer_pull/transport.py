"""The worker-role peer-pull transport: consumers pull items from producers' registered pools.

Producer worker: `put` copies the encoder output once into its registered pool (or, where the
data path allows, holds a large host item where it lies, `producer_put`) and announces it
(ZMQ PUB). A ZMQ ROUTER side channel answers `Pull` (server.py); small items ride inline in
the reply (one round trip, no data path), larger ones move on the data path this transport
was given (data_path.py: mooncake_te/'s engine writes or socket stream, nixl_pull/'s reads).
Items are held under a byte budget (the pool, producer_store.py): leased for `lease_ttl_s`
after their save or latest promise, never deleted on pull (any number of consumers), evicted
only when unpinned, by the lease book's order (../leases.py); when everything is leased a
save waits (backpressure) and then fails loudly.

Consumer worker: `get` allocates from its own pool, has the data path move the item in,
waits with a size-scaled deadline, verifies the checksum, and hands the pool block itself
over as the tensor (puller.py: no copy; the block returns to the pool when the tensor is
dropped, so size the consumer pool for vLLM's encoder cache plus pulls in flight; a full pool
only delays pulls until their deadline, then the item is encoded locally).

Scheduler process: the catalog (catalog.py) subscribes to producers' announcements and
answers `list_keys` / `locate` from memory (the availability index).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch
import zmq

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.protocol.curve import data_plane_host
from ec_connectors.protocol.keys import item_key
from ec_connectors.protocol.ports import (
    PURPOSE_ANNOUNCE,
    PURPOSE_SERVE,
    PURPOSE_STREAM,
    port_for,
)
from ec_connectors.protocol.secret_file import SECRET_ENV
from ec_connectors.protocol.stored import ItemInfo
from ec_connectors.transports.base import (
    Placement,
    Transport,
    dtype_name,
    host_copy,
    tensor_bytes,
)
from ec_connectors.transports.hashed_copy import (
    copy_with_peer_checksum,
    helper_threads,
    peer_checksum,
)
from ec_connectors.transports.memory import MemoryPool, PoolBuffer
from ec_connectors.transports.peer_pull.announcer import Announcer
from ec_connectors.transports.peer_pull.data_path import DataPath, PeerReader, PullCounters
from ec_connectors.transports.peer_pull.link import PeerLink
from ec_connectors.transports.peer_pull.messages import side_channel_decoder
from ec_connectors.transports.peer_pull.producer_store import HeldInPlace, ProducerStore
from ec_connectors.transports.peer_pull.puller import Puller
from ec_connectors.transports.peer_pull.server import PullServer
from epd_common.net import holders, resolve_host

logger = get_logger(__name__)


class PeerPullError(RuntimeError):
    """A peer-pull transport cannot start (its ports, its data path)."""


class PeerPullTransport(Transport):
    """Worker-role transport over a data path (see the module docstring). One per worker.

    Each transport gives it its data path and its name (mooncake_te/transport.py,
    nixl_pull/transport.py); `make_transport` builds those."""

    name = "peer_pull"

    def __init__(self, config: EPDConfig, placement: Placement, path: DataPath,
                 host: str | None = None) -> None:
        super().__init__()
        self.config, self.placement, self.path = config, placement, path
        self.curve = config.curve
        self.host = host or peer_host(config)
        self.namespace = config.scope  # one model (name and fingerprint) per producer process
        self._zmq = zmq.Context()  # ours alone, so close() can terminate it
        self._decode = side_channel_decoder(path.messages)
        self.pool = MemoryPool(config.memory_pool_bytes, config.memory_pool_device,
                               register=path.register)
        path.attach(self.pool)
        self.store: ProducerStore | None = None
        self._hash_exec: ThreadPoolExecutor | None = None
        self._hash_threads = 1
        self.server: PullServer | None = None
        self.announcer: Announcer | None = None
        self._endpoint = ""
        # one set of pull counters: the consumer's pulls and the producer's refusals
        self.counters = PullCounters()
        self.puller = Puller(config, self.pool, path.session, self.namespace,
                             self._reader, self.events, self.counters)
        if placement.is_producer:
            self._start_producer()

    @property
    def endpoint(self) -> str:
        """The producer's side channel ("host:port"; "" on a consumer-only worker)."""
        return self._endpoint

    def _reader(self, endpoint: str) -> PeerReader:
        def open_link(hello: msgspec.Struct | None, on_other=None) -> PeerLink:
            return PeerLink(endpoint, self._zmq, self._decode, self.curve, hello=hello,
                            on_other=on_other)
        return self.path.reader(endpoint, open_link)

    def _start_producer(self) -> None:
        p, c = self.placement, self.config
        ports = [port_for(c.base_port, purpose, c.stage_offset, p.dp_rank, p.world_size, p.rank)
                 for purpose in (PURPOSE_SERVE, PURPOSE_ANNOUNCE, PURPOSE_STREAM)]
        self._endpoint = f"{self.host}:{ports[0]}"
        self.store = ProducerStore(self.pool, c.lease_ttl_s, c.lease_min_s)
        # a put copies into the pool and hashes on two threads (one per core at most)
        self._hash_exec, self._hash_threads = helper_threads(2, "epd-put-hash")
        listening = False
        try:
            moves = self.path.listen(self.host, ports[2])  # a port taken fails before threads
            listening = True
            self.server = PullServer(f"tcp://{self.host}:{ports[0]}", self.endpoint,
                                     self.store, self.path, c, self.namespace, self.counters,
                                     self._zmq, self._decode, curve=self.curve)
            self.announcer = Announcer(f"tcp://{self.host}:{ports[1]}", self.endpoint,
                                       self.store, c.announce_interval_s, self._zmq,
                                       self.namespace, curve=self.curve)
        except (OSError, RuntimeError, zmq.ZMQError) as exc:
            if listening:
                self.path.stop_serving()
            raise PeerPullError(
                f"cannot listen on {self.host}:{'/'.join(map(str, ports))} ({exc}); "
                f"{holders(ports) or 'another process uses the port'}: set base_port or "
                "stage_offset") from exc
        logger.info("EPD %s producer: side channel %s, announcements :%d, %s, engine "
                    "%s, pool %d MiB on %s", self.name, self.endpoint, ports[1], moves,
                    self.path.session or "none", self.pool.capacity >> 20,
                    c.memory_pool_device)

    # -- producer ------------------------------------------------------------------------------
    def put(self, item_id: str, tensor: torch.Tensor) -> ItemInfo:
        """Producer: hold an item for consumers to pull and announce it (Transport.put)."""
        if self.store is None:
            raise RuntimeError(f"put() on a consumer-only {self.name} transport")
        key = item_key(item_id)
        held = self.store.get(key)
        if held is not None:  # same content id, same bytes: renew the promise, store nothing
            self.store.renew(key)
            return held.info
        host_view = host_copy(tensor).contiguous()
        data = tensor_bytes(host_view)
        n = len(data)
        deadline = time.monotonic() + self.config.save_queue_timeout_s
        buf, evicted = self.store.reserve(n, deadline)
        try:
            held, digest = self._hold(buf, tensor, host_view, data)
        except BaseException:
            buf.release()
            raise
        info = ItemInfo(item_id=item_id, key=key, shape=tuple(tensor.shape),
                        dtype=dtype_name(tensor.dtype), nbytes=n, checksum=digest,
                        location=self.endpoint)
        info = self.store.add(info, held)
        if evicted:
            self.events.evictions += len(evicted)
            self.events.evicted_bytes += sum(h.info.nbytes for h in evicted)
        if self.announcer is not None:
            self.announcer.evicted([h.info.key for h in evicted])
            self.announcer.stored(info)
        return info

    def _hold(self, buf: PoolBuffer, tensor: torch.Tensor, host_view: torch.Tensor,
              data: memoryview) -> tuple[PoolBuffer | HeldInPlace, str]:
        """Hold a new item; returns what holds it and its checksum.

        Where it lies when the data path allows (`buf` then only counts its bytes), else
        copied into its pool block `buf`."""
        n = len(data)
        if self.pool.device == "cpu" and n > self.config.inline_max_bytes \
                and n >= self.config.in_place_min_bytes and self.path.holds_in_place() \
                and HeldInPlace.fits(host_view, n):
            digest = peer_checksum(data, self._hash_exec, self._hash_threads)
            held = self.path.hold_in_place(buf, host_view)
            if held is not None:
                self.events.held_in_place += 1
                return held, digest
        if self.pool.device == "cpu":  # one pass: copied and hashed chunk by chunk
            return buf, copy_with_peer_checksum(buf.addr, buf.as_bytes()[:n],
                                                host_view.data_ptr(), n, self._hash_exec,
                                                self._hash_threads) if n else \
                peer_checksum(data)
        buf.write(tensor)  # the device copy from the tensor, the checksum from its host copy
        return buf, peer_checksum(data, self._hash_exec, self._hash_threads)

    # -- consumer ------------------------------------------------------------------------------
    def get(self, item_id: str, deadline: float, location: str = "",
            nbytes: int = 0, *, wait: bool = True) -> torch.Tensor | None:
        """Consumer: pull an item from its producer by `deadline`, verified (Transport.get)."""
        return self.puller.get(item_id, deadline, location, nbytes, wait=wait)

    # -- the rest of the interface ---------------------------------------------------------------
    def renew(self, item_id: str) -> None:
        """Producer: renew the item's lease (promised again)."""
        if self.store is not None:
            self.store.renew(item_key(item_id))

    def expect(self, item_id: str) -> None:
        """Producer: its save is queued; pulls of it are answered "pending" until put or failed."""
        if self.store is not None:
            self.store.expect(item_key(item_id))

    def save_failed(self, item_id: str, reason: str) -> None:
        """Producer: its save failed; pulls of it are answered "failed" from now on."""
        if self.store is not None:
            self.store.failed(item_key(item_id))

    def exists(self, item_id: str) -> bool:
        """Producer: whether this worker holds the item."""
        return self.store is not None and self.store.get(item_key(item_id)) is not None

    def list_keys(self) -> Iterable[str]:
        """Producer: the keys this worker holds."""
        return self.store.catalog()[0] if self.store is not None else []

    def delete(self, item_id: str) -> bool:
        """Never deletes: items leave by lease expiry and LRU, never on request."""
        return False

    def reap(self) -> None:
        """Consumer: free buffers producers never answered for (`quarantine_ttl_s`)."""
        self.puller.reap(self.config.quarantine_ttl_s)

    def health(self) -> dict[str, object]:
        """The worker's pool, items, quarantine, pull counters and the data path's keys."""
        return {"transport": self.name, "ok": True, "endpoint": self.endpoint,
                "session": self.path.session, "pool_addr": self.pool.base_addr,
                "pool_used_bytes": self.pool.used_bytes,
                "pool_bytes": self.pool.capacity, "held_items": len(self.store or ()),
                "quarantined": self.puller.quarantined(), **self.counters.counters(),
                **self.path.health()}

    def close(self) -> None:
        """Stop serving and pulling, free the pool, then the data path's resources."""
        for part in (self.server, self.announcer):
            if part is not None:
                part.close()
        self.puller.close()
        if self._hash_exec is not None:
            self._hash_exec.shutdown(wait=True)  # no put is copying into the pool now
        if self.store is not None:
            self.store.clear()
        self.pool.close()
        self.path.close()
        self._zmq.destroy(linger=0)  # sockets are closed by now; never waits


def peer_host(config: EPDConfig) -> str:
    """The host a worker's peer-pull sockets serve on: loopback without a deployment secret.

    Warns once per worker where that is not the configured host."""
    host = data_plane_host(config.host, config.curve is not None)
    if host != resolve_host(config.host):
        logger.warning("EPD mooncake: no deployment secret (secret_file or $%s): the side "
                       "channel, announcements and transfer engine serve loopback only, "
                       "not %s; give every EPD process the same secret to serve other "
                       "hosts", SECRET_ENV, resolve_host(config.host))
    return host
