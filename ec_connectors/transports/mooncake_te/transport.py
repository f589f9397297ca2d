"""Mooncake Transfer Engine transport: consumers pull items from producers' registered pools.

Producer worker: `put` copies the encoder output once into its registered pool (or, on the
socket path, holds a large host item where it lies, `producer_put`) and announces it (ZMQ
PUB). A ZMQ ROUTER side channel answers `Pull`; small items ride inline in the reply
(one round trip, no data path). Larger items take one of two data paths (`te_data_path`, the
same in every process of a deployment; `auto`: socket over TCP with host pools, else engine):
- engine: the producer writes the item straight into the consumer's registered buffer with
  the transfer engine (RDMA or TCP; engine.py), then replies `Pulled`. Every side-channel
  connection opens with the consumer's `Register`: its pool's range, proven by a nonce the
  producer reads back from the consumer's memory; writes go only into that range, so a peer
  cannot aim a producer at another consumer's buffers.
- socket: the consumer opens warm data connections of its own to the producer's stream port
  (a single-use ticket sent over the side channel, CURVE with a deployment secret) and reads
  each item into its own pool block from one request and one reply (stream.py has the
  protocol; stream_server.py the producer's end, stream_client.py the consumer's). Nothing is
  written into the consumer's memory from outside, and no engine is started (needs_engine).
Items are held under a byte budget (the pool, producer_store.py): leased for `lease_ttl_s`
after their save or latest promise, never deleted on pull (any number of consumers), evicted
only when unpinned, by the lease book's order (../leases.py); when everything is leased a
save waits (backpressure) and then fails loudly.

Consumer worker: `get` allocates from its own pool, has the item written or streams it in,
waits with a size-scaled deadline, verifies the checksum, and hands the pool block itself
over as the tensor (no copy; the block returns to the pool when the tensor is dropped, so
size the consumer pool for vLLM's encoder cache plus pulls in flight; a full pool only delays
pulls until their deadline, then the item is encoded locally). On the engine path a buffer
whose pull timed out may still be written by a frozen producer: it is quarantined until that
producer answers or disconnects (or `quarantine_ttl_s`), never reused early.

Scheduler process: `catalog.MooncakeCatalog` subscribes to producers'
announcements and answers `list_keys` / `locate` from memory (the availability index).

Routing, retries across tiers and request lifecycle live above (ec_connectors/workers/,
scheduler_hooks/).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
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
from ec_connectors.transports.mooncake_te.announcer import Announcer
from ec_connectors.transports.mooncake_te.consumer import Puller
from ec_connectors.transports.mooncake_te.engine import (
    TransferEngineUnavailable,
    needs_engine,
    start_engine,
)
from ec_connectors.transports.mooncake_te.messages import PeerMessage, Register
from ec_connectors.transports.mooncake_te.peer_link import PeerLink
from ec_connectors.transports.mooncake_te.producer import ConsumerRanges, PullServer
from ec_connectors.transports.mooncake_te.producer_store import HeldInPlace, ProducerStore
from ec_connectors.transports.mooncake_te.stream_server import StreamServer
from epd_common.net import holders, resolve_host

logger = get_logger(__name__)

_OWN_PAGE = 4096  # registered page: our proof nonce, then a producer's scratch slots


class MooncakeTransport(Transport):
    """Worker-role transport (see module docstring). One per worker process."""

    name = "mooncake"

    def __init__(self, config: EPDConfig, placement: Placement) -> None:
        super().__init__()
        self.config = config
        self.placement = placement
        self.curve = config.curve
        self.host = data_plane_host(config.host, self.curve is not None)
        if self.host != resolve_host(config.host):
            logger.warning("EPD mooncake: no deployment secret (secret_file or $%s): the side "
                           "channel, announcements and transfer engine serve loopback only, "
                           "not %s; give every EPD process the same secret to serve other "
                           "hosts", SECRET_ENV, resolve_host(config.host))
        self.namespace = config.scope  # one model (name and fingerprint) per producer process
        self.engine = self._start_engine()
        self._zmq = zmq.Context()  # ours alone, so close() can terminate it
        self.session = f"{self.host}:{self.engine.get_rpc_port()}" if self.engine else ""
        self.pool = MemoryPool(config.memory_pool_bytes, config.memory_pool_device,
                               register=self._register)
        # Our own registered page: the nonce a consumer proves its session with (first
        # bytes), and a producer's scratch for reading other consumers' proofs (the rest).
        self._own = torch.zeros(_OWN_PAGE, dtype=torch.uint8)
        self._register(self._own.data_ptr(), _OWN_PAGE, "cpu:0")
        nonce = os.urandom(ConsumerRanges.NONCE_BYTES)
        self._own[:len(nonce)] = torch.frombuffer(bytearray(nonce), dtype=torch.uint8)
        self.store: ProducerStore | None = None
        self._hash_exec: ThreadPoolExecutor | None = None
        self._hash_threads = 1
        self.server: PullServer | None = None
        self.announcer: Announcer | None = None
        self._endpoint = ""
        # one set of pull counters: the consumer's pulls and the producer's refusals
        self.pull_stats = {"pulls": 0, "inline": 0, "unknown": 0, "evicted": 0,
                           "transfer_errors": 0, "expired": 0, "unregistered": 0,
                           "streamed": 0, "stream_errors": 0,
                           "stream_connections": 0}
        self.puller = Puller(config, self.pool, self.session, self.namespace,
                             self._make_link(self._hello(nonce)), self.events, self.pull_stats)
        if placement.is_producer:
            self._start_producer()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    # -- the data path's hooks (nixl_pull/ overrides them) -----------------------------------
    def _start_engine(self):
        """The transfer engine, or None where items do not move through it.

        None on the socket data path: its listeners would bind every interface for nothing."""
        return start_engine(self.config, self.host) if needs_engine(self.config) else None

    def _hello(self, nonce: bytes) -> msgspec.Struct | None:
        """What opens every side-channel connection: the range pulls may be written into."""
        if self.engine is None:  # no engine: nothing is written into us
            return None
        return Register(session=self.session, base=self.pool.base_addr,
                        length=self.pool.capacity, proof_addr=self._own.data_ptr(),
                        nonce=nonce)

    def _make_link(self, hello: PeerMessage) -> Callable[[str], PeerLink]:
        """How the puller builds its link to one producer, opened with `hello`."""
        def make(endpoint: str) -> PeerLink:
            return PeerLink(endpoint, self._zmq, self.curve, hello=hello,
                            stream=self.config.te_socket)
        return make

    def _streams_wanted(self) -> bool:
        return self.config.te_socket

    def _make_server(self, *args, **kwargs) -> PullServer:
        return PullServer(*args, **kwargs)

    def _register(self, addr: int, size: int, location: str = "") -> None:
        if self.engine is None:
            return
        location = location or ("cpu:0" if self.config.memory_pool_device == "cpu" else
                                f"cuda:{torch.cuda.current_device()}")
        try:
            rc = self.engine.register_memory(addr, size, location)
        except TypeError:  # wheels before 0.3.13 take no location (they detect it)
            rc = self.engine.register_memory(addr, size)
        if rc != 0:
            raise TransferEngineUnavailable(f"register_memory of the {size}-byte pool failed "
                                            f"with {rc}")

    def _start_producer(self) -> None:
        p, c = self.placement, self.config
        ports = [port_for(c.base_port, purpose, c.stage_offset, p.dp_rank, p.world_size, p.rank)
                 for purpose in (PURPOSE_SERVE, PURPOSE_ANNOUNCE, PURPOSE_STREAM)]
        self._endpoint = f"{self.host}:{ports[0]}"
        self.store = ProducerStore(self.pool, c.lease_ttl_s, c.lease_min_s)
        # a put copies into the pool and hashes on two threads (one per core at most)
        self._hash_exec, self._hash_threads = helper_threads(2, "epd-put-hash")
        self.in_place = self._holds_in_place()
        read = self.engine.transfer_sync_read if self.engine else (lambda *_: -1)
        ranges = ConsumerRanges(read, memoryview(self._own.numpy()), self._own.data_ptr())
        streams = None
        try:
            if self._streams_wanted():  # first: a port taken fails before any thread runs
                streams = StreamServer(self.host, ports[2])
            self.server = self._make_server(f"tcp://{self.host}:{ports[0]}", self.endpoint,
                                            self.store, ranges, self.engine, c,
                                            self.namespace, self.pull_stats, self._zmq,
                                            curve=self.curve, streams=streams)
            self.announcer = Announcer(f"tcp://{self.host}:{ports[1]}", self.endpoint,
                                       self.store, c.announce_interval_s, self._zmq,
                                       self.namespace, curve=self.curve)
        except (OSError, RuntimeError, zmq.ZMQError) as exc:
            if streams is not None:
                streams.close()
            raise TransferEngineUnavailable(
                f"cannot listen on {self.host}:{'/'.join(map(str, ports))} ({exc}); "
                f"{holders(ports) or 'another process uses the port'}: set base_port or "
                "stage_offset") from exc
        logger.info("EPD mooncake producer: side channel %s, announcements :%d, %s, engine "
                    "%s, pool %d MiB on %s", self.endpoint, ports[1],
                    f"data connections :{ports[2]}" if streams else "engine writes",
                    self.session or "none", self.pool.capacity >> 20, c.memory_pool_device)

    # -- producer ------------------------------------------------------------------------------
    def put(self, item_id: str, tensor: torch.Tensor) -> ItemInfo:
        if self.store is None:
            raise RuntimeError("put() on a consumer-only mooncake transport")
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

        Where it lies when `producer_put` allows (`buf` then only counts its bytes), else
        copied into its pool block `buf`."""
        n = len(data)
        if self.in_place and self.pool.device == "cpu" and n > self.config.inline_max_bytes \
                and n >= self.config.in_place_min_bytes and HeldInPlace.fits(host_view, n):
            digest = peer_checksum(data, self._hash_exec, self._hash_threads)
            held = self._hold_in_place(buf, host_view)
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

    def _holds_in_place(self) -> bool:
        """Whether large host items are held where they lie.

        On the socket path (sent from there); the engine writes only from registered memory."""
        return self.config.producer_put != "copy" and self._streams_wanted()

    def _hold_in_place(self, buf: PoolBuffer, tensor: torch.Tensor) -> HeldInPlace | None:
        """An item held where it lies, or None to copy it after all."""
        return HeldInPlace(buf, tensor)

    # -- consumer ------------------------------------------------------------------------------
    def get(self, item_id: str, deadline: float, location: str = "",
            nbytes: int = 0, *, wait: bool = True) -> torch.Tensor | None:
        return self.puller.get(item_id, deadline, location, nbytes, wait=wait)

    # -- the rest of the interface ---------------------------------------------------------------
    def renew(self, item_id: str) -> None:
        if self.store is not None:
            self.store.renew(item_key(item_id))

    def expect(self, item_id: str) -> None:
        if self.store is not None:  # pulls of it are answered "pending" until put or failed
            self.store.expect(item_key(item_id))

    def save_failed(self, item_id: str, reason: str) -> None:
        if self.store is not None:  # pulls of it are answered "failed" from now on
            self.store.failed(item_key(item_id))

    def exists(self, item_id: str) -> bool:
        return self.store is not None and self.store.get(item_key(item_id)) is not None

    def list_keys(self) -> Iterable[str]:
        return self.store.catalog()[0] if self.store is not None else []

    def delete(self, item_id: str) -> bool:
        return False  # items leave by lease expiry and LRU, never on request

    def reap(self) -> None:
        self.puller.reap(self.config.quarantine_ttl_s)

    def health(self) -> dict[str, object]:
        quarantined = self.puller.quarantined()
        return {"transport": self.name, "ok": True, "endpoint": self.endpoint,
                "session": self.session, "pool_addr": self.pool.base_addr,
                "pool_used_bytes": self.pool.used_bytes,
                "pool_bytes": self.pool.capacity, "held_items": len(self.store or ()),
                "quarantined": quarantined, **self.pull_stats}

    def close(self) -> None:
        for part in (self.server, self.announcer):
            if part is not None:
                part.close()
        self.puller.close()
        if self._hash_exec is not None:
            self._hash_exec.shutdown(wait=True)  # no put is copying into the pool now
        if self.store is not None:
            self.store.clear()
        self.pool.close()
        for addr in (self.pool.base_addr, self._own.data_ptr()) if self.engine else ():
            with contextlib.suppress(Exception):
                self.engine.unregister_memory(addr)
        self.engine = None
        self._zmq.destroy(linger=0)  # sockets are closed by now; never waits
