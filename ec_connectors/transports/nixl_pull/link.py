"""Consumer side of the NIXL transport: a producer's agent, and pulls as NIXL reads.

`NixlPeerLink` is a consumer's way to one producer: the core's side channel to it
(peer_pull/link.py: authenticated, pulls with deadlines, replies), whose connections open
with `NixlHello`, and NIXL reads. The producer's answer (`NixlPeer`: its agent's metadata
and registered range) is checked and loaded, and a first small read warms the UCX
connection, on a thread of its own, off the request path. A pull then asks the producer over
the side channel where the item lies (`Pulled` with `src_addr` and a token), checks that the
place lies inside the range the producer registered and fits our block, and READs it into
our own registered pool block with the pull's deadline, the token as the read's notification
(the producer drops its pin). The Puller above verifies the bytes (checksum) as for every
data path. A read still in flight at its deadline keeps its block out of the pool until NIXL
says it ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ec_connectors.log import get_logger
from ec_connectors.transports.memory import PoolBuffer
from ec_connectors.transports.nixl_pull.agent import NixlAgent
from ec_connectors.transports.nixl_pull.host import kernel_identity, mem_kind
from ec_connectors.transports.nixl_pull.messages import NixlHello, NixlPeer
from ec_connectors.transports.nixl_pull.peers import region_of
from ec_connectors.transports.nixl_pull.reads import ReadState
from ec_connectors.transports.nixl_pull.server import TOKEN_BYTES, NixlCounters
from ec_connectors.transports.peer_pull.data_path import OpenLink
from ec_connectors.transports.peer_pull.link import PendingPull
from ec_connectors.transports.peer_pull.messages import Pulled, PullFailed

logger = get_logger(__name__)

_WARM_BYTES = 64
_WARM_READ_S = 5.0  # the deadline of a link's first (warming) read


class NixlPeerLink:
    """A consumer's way to one NIXL producer (see the module docstring).

    `location` is where this consumer's pool lives ("cpu", "cuda:0"); `scratch` a
    registered (addr, nbytes) of host memory the warming read lands in; `counters` the data
    path's counters; `chunk` the size of the reads an item is moved in (0: one read), each
    verified while the next is copied."""

    def __init__(self, endpoint: str, open_link: OpenLink, agent: NixlAgent, location: str,
                 scratch: tuple[int, int], counters: NixlCounters, hello: NixlHello,
                 chunk: int = 0) -> None:
        self.endpoint = endpoint
        self.agent, self.location, self.scratch = agent, location, scratch
        self.counters, self.chunk = counters, chunk
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="epd-nixl-verify")
        self.peer: NixlPeer | None = None
        self.peer_error = ""
        self._ready = threading.Event()
        self._split = False  # large reads are split across the agent's lanes (_learn)
        self._lock = threading.Lock()
        self._reading: list[tuple[object, PoolBuffer]] = []  # reads given up on, still live
        self.link = open_link(hello, self._on_message)  # last: answers may come at once

    @property
    def broken(self) -> bool:
        """Whether the side channel was lost (the puller then makes a new link)."""
        return self.link.broken

    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, NixlPeer) and self.peer is None:
            # a reconnection sends it again: the first one stands
            threading.Thread(target=self._learn, args=(msg,), daemon=True,
                             name="epd-nixl-peer").start()

    def _learn(self, msg: NixlPeer) -> None:
        """Check and load a producer's agent, then warm the connection with a small read."""
        try:
            if msg.base <= 0 or msg.length <= 0 or msg.mem not in ("DRAM", "VRAM") \
                    or msg.device < 0 or len(msg.warm) != TOKEN_BYTES:
                raise ValueError("a malformed registered range")
            self.agent.add_peer(msg.agent, msg.metadata)
            # host memory to host memory in one kernel: UCX's cma, a copy by the posting
            # thread; device memory moves by the GPU's copy engines (not measured split)
            self._split = bool(msg.kernel) and msg.kernel == kernel_identity() \
                and msg.mem == "DRAM" and mem_kind(self.location)[0] == "DRAM"
            self.peer = msg
            n = min(_WARM_BYTES, msg.length, self.scratch[1])
            state, _ = self.agent.read((self.scratch[0], n, "cpu"),
                                       (msg.base, msg.mem, msg.device), n, msg.agent,
                                       msg.warm, time.monotonic() + _WARM_READ_S)
            if state is not ReadState.DONE:
                logger.warning("EPD nixl: the first read from %s (%s) came to %s",
                               self.endpoint, msg.agent, state)
        except ValueError as exc:
            self.peer_error = str(exc)
            logger.warning("EPD nixl: refused the agent of producer %s: %s", self.endpoint, exc)
        finally:
            self._ready.set()

    def pull(self, key: str, session: str, buf: PoolBuffer | None, timeout_s: float,
             on_progress: Callable[[int], None] | None = None, namespace: str = ""
             ) -> PendingPull:
        """Ask where the item lies (for `session`), then READ it into `buf` by the deadline."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        if buf is not None and (not self._ready.wait(timeout_s) or self.peer is None):
            return PendingPull(buf, finished=True, reply=PullFailed(  # a miss now, not retried
                pull_id=0, code="unregistered", error=f"no NIXL agent from {self.endpoint}: "
                f"{self.peer_error or 'none in time'}"))
        p = self.link.pull(key, session, buf, max(0.0, deadline - time.monotonic()), None,
                           namespace)
        # (chunks are verified as they land, on a thread of this link: one copies, one hashes)
        reply = p.reply
        if buf is None or p.buf is None or not isinstance(reply, Pulled) or reply.inline:
            return p
        peer, n = self.peer, reply.info.nbytes
        # an item held where it lies comes with its own registration (NIXL checks the read
        # against it); else it must lie in the pool the producer registered
        if reply.region and not region_of(peer.agent, reply.region):
            p.reply = PullFailed(pull_id=reply.pull_id, code="corrupt",
                                 error=f"{self.endpoint} sent a malformed or foreign region")
            return p
        if not (0 < n <= buf.nbytes and (reply.region or (
                peer.base <= reply.src_addr and reply.src_addr + n <= peer.base + peer.length))):
            p.reply = PullFailed(pull_id=reply.pull_id, code="corrupt",
                                 error=f"{self.endpoint} placed {n} bytes at "
                                       f"{reply.src_addr:#x}, outside its registered range")
            return p
        hashed: list[Future] = []

        def hash_chunk(end: int) -> None:
            if end < n:  # verified on our thread while the next read copies
                hashed.append(self._hasher.submit(on_progress, end))
                return
            for done in hashed:  # in order; the last piece here, on the verifier's threads
                done.result()
            hashed.clear()
            on_progress(end)

        state, live = self.agent.read((buf.addr, n, self.location),
                                      (reply.src_addr, peer.mem, peer.device), n, peer.agent,
                                      reply.token, deadline, self.chunk,
                                      None if on_progress is None else hash_chunk,
                                      split=self._split, region_md=reply.region)
        for done in hashed:  # the verifier is the caller's again once this returns
            done.result()
        self.counters.nixl_reads += 1
        if self.agent.stripes(n, self._split) > 1:
            self.counters.nixl_split_reads += 1
        if state is ReadState.DONE:
            return p
        p.reply = None
        if state is ReadState.TIMED_OUT:
            self.counters.nixl_read_timeouts += 1
            p.error = f"NIXL read from {self.endpoint} took longer than {timeout_s:.2f} s"
            if live is not None:  # still writing into buf: hold it until it ends
                with self._lock:
                    self._reading.append((live, buf))
                p.buf = None
        else:
            self.counters.nixl_read_errors += 1
            p.reply = PullFailed(pull_id=reply.pull_id, code="transfer",
                                 error=f"NIXL read from {self.endpoint} failed")
        return p

    def reap(self, ttl_s: float) -> None:
        """Free buffers of reads that ended since they were given up on; the link's too."""
        self.link.reap(ttl_s)
        with self._lock:
            live, self._reading = self._reading, []
        for handle, buf in live:
            if self.agent.read_ended(handle):
                buf.release()
            else:
                with self._lock:
                    self._reading.append((handle, buf))

    @property
    def quarantined(self) -> int:
        """Buffers a read or the side channel's pull may still write into."""
        return self.link.quarantined + len(self._reading)

    def close(self) -> None:
        """Close the side channel and forget the producer's agent."""
        self.link.close()
        self._hasher.shutdown(wait=False)
        if self.peer is not None:  # a restarted producer comes back as another agent
            self.agent.forget(self.peer.agent)


def pool_location(device: str) -> str:
    """The torch location of a consumer pool on `device` ("cpu" or "cuda"), for mem_kind."""
    if device == "cpu":
        return "cpu"
    import torch

    location = f"cuda:{torch.cuda.current_device()}"
    mem_kind(location)
    return location
