"""The socket data path of the `mooncake` transport (te_data_path socket).

`SocketPath` is what the core (peer_pull/) is given: a producer listens on its stream port
(stream_server.py) and answers each pull on a served data connection from the thread that
reads it, the reply and then the item's bytes; a consumer runs each pull on one of a few warm
data connections to the producer (`SocketReader`, stream_client.py), its ticket sent over
the side channel first (`StreamOpen`). Nothing is written into the consumer's memory from
outside, no engine runs, and a large host item is sent from where it lies (`producer_put`).
stream.py has the protocol both ends share."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.protocol.ports import stream_port
from ec_connectors.transports.memory import MemoryPool, PoolBuffer
from ec_connectors.transports.mooncake_te import stream, stream_client, stream_server
from ec_connectors.transports.mooncake_te.engine import give_up_s
from ec_connectors.transports.mooncake_te.messages import (
    MESSAGES,
    StreamOpen,
    writes_nothing,
)
from ec_connectors.transports.mooncake_te.stream_client import Connections
from ec_connectors.transports.peer_pull.data_path import OpenLink, Server
from ec_connectors.transports.peer_pull.link import PendingPull
from ec_connectors.transports.peer_pull.messages import Pull, Pulled, PullFailed
from ec_connectors.transports.peer_pull.producer_store import HeldInPlace, PinnedItem
from ec_connectors.transports.peer_pull.server import expires_at, too_small
from epd_common.net import parse_endpoint

logger = get_logger(__name__)


class SocketPath:
    """The socket data path of one worker (see the module docstring); no engine, no session."""

    messages = MESSAGES
    session = ""

    def __init__(self, config: EPDConfig) -> None:
        self.config = config
        self.streams: stream_server.StreamServer | None = None
        self._server: Server | None = None

    # -- memory: nothing is registered -------------------------------------------------------
    def register(self, addr: int, size: int, location: str = "") -> None:
        """Nothing to register: the consumer's own thread reads into its memory."""

    def attach(self, pool: MemoryPool) -> None:
        """Nothing to take: no range is claimed."""

    # -- producer ----------------------------------------------------------------------------
    def holds_in_place(self) -> bool:
        """Unless `producer_put` is copy: an item is sent from where it lies."""
        return self.config.producer_put != "copy"

    def hold_in_place(self, buf: PoolBuffer, tensor: torch.Tensor) -> HeldInPlace | None:
        """The tensor itself, its pool block only counting its bytes."""
        return HeldInPlace(buf, tensor)

    def listen(self, host: str, port: int) -> str:
        """Open the stream port (a port taken fails here, before any thread runs)."""
        self.streams = stream_server.StreamServer(host, port)
        return f"data connections :{port}"

    def start_serving(self, server: Server) -> None:
        """Serve data connections with `server`'s answers."""
        self._server = server
        self.streams.set_serve(self._serve_connection)

    def on_message(self, server: Server, msg: Any, peer: bytes) -> bool:
        """A `StreamOpen` makes its ticket live; an engine consumer's `Register` is ignored."""
        if isinstance(msg, StreamOpen):
            self.streams.expect(msg.ticket)
            return True
        return isinstance(msg, MESSAGES)

    def serve_held(self, server: Server, msg: Pull, peer: bytes, held: PinnedItem,
                   expires: float) -> bool:
        """A large item asked on the side channel: the engine would write it; none runs."""
        server.counters.unregistered += 1
        server.reply(peer, writes_nothing(msg.pull_id, server.endpoint, "it"))
        return False

    def stop_serving(self) -> None:
        """Close the stream port and its connections (a send in flight fails at once)."""
        if self.streams is not None:
            self.streams.close()

    def _serve_connection(self, conn: socket.socket) -> None:
        """Serve the pulls of one data connection until it ends.

        A served data connection (its ticket came over the side channel): `READY`, then
        its pulls one after another, each answered on it from this thread (nothing is
        written into the consumer: no range to check). Returns, and the connection is
        closed, when it is idle, closed, sends garbage or a reply cannot be sent."""
        conn.settimeout(self.config.transfer_timeout_base_s)
        try:
            conn.sendall(stream.READY)
        except OSError:  # the consumer gave up on it already
            return
        while (msg := stream_server.read_request(conn)) is not None:
            try:
                self._serve_streamed(conn, msg, expires_at(msg))
            except (OSError, stream.StreamError) as exc:
                self._server.counters.stream_errors += 1
                logger.warning("EPD: streaming %s to a consumer failed: %s", msg.key, exc)
                return

    def _serve_streamed(self, conn: socket.socket, msg: Pull, expires: float) -> None:
        """Serve one pull on a data connection.

        The same answers as on the side channel (expired, namespace, unknown / pending /
        evicted / failed, too_small), else `Pulled` (the digest) and the item's bytes in one
        stream, sent by the pull's deadline."""
        server = self._server
        held, reply = server.claim(msg, expires)
        if held is not None:
            reply = too_small(msg, held)
        try:
            if reply is not None:  # a few bytes, even past the deadline
                stream_server.send_reply(conn, reply,
                                         time.monotonic() + self.config.transfer_timeout_base_s)
                return
            stream_server.send_reply(conn, Pulled(pull_id=msg.pull_id, info=held.info),
                                     min(expires, time.monotonic()
                                         + give_up_s(self.config, held.info.nbytes)), held.buf)
        finally:
            if held is not None:
                server.store.unpin(held)

    # -- consumer ----------------------------------------------------------------------------
    def reader(self, endpoint: str, open_link: OpenLink) -> SocketReader:
        """Warm data connections to the producer at `endpoint`, beside its side channel."""
        return SocketReader(endpoint, open_link)

    def health(self) -> dict[str, object]:
        """No keys of its own (the core's counters count streamed pulls)."""
        return {}

    def close(self) -> None:
        """Nothing is held beyond the stream port, closed with the server."""


class SocketReader:
    """A consumer's way to one producer on the socket path.

    Each pull into a buffer runs on one of a few warm data connections to the producer's
    stream port (stream_client.Connections; their tickets go over the side channel), request
    and reply on that socket. A producer without a stream listener would write with the
    engine, which only a consumer with an engine session can take."""

    def __init__(self, endpoint: str, open_link: OpenLink) -> None:
        host, port = parse_endpoint(endpoint)
        self.endpoint = endpoint
        self.link = open_link(None, None)
        self.streams = Connections(host, stream_port(port), self._open_stream)

    @property
    def broken(self) -> bool:
        """Whether the side channel was lost (the puller then makes a new reader)."""
        return self.link.broken

    def pull(self, key: str, session: str, buf: PoolBuffer | None, timeout_s: float,
             on_progress: Callable[[int], None] | None = None, namespace: str = ""
             ) -> PendingPull:
        """Pull one item on a data connection (a size or small item: on the side channel)."""
        if buf is not None:
            pending = self._pull_streamed(key, buf, timeout_s, on_progress, namespace)
            if pending is not None:
                return pending
            # the producer takes no data connection (engine path): it writes with the engine
            if not session:  # ... which this process does not run (needs_engine)
                return PendingPull(buf, finished=True, reply=PullFailed(
                    pull_id=0, code="unregistered", error=f"{self.endpoint} writes with the "
                    "engine only; this process has none (set te_data_path alike everywhere)"))
        return self.link.pull(key, session, buf, timeout_s, on_progress, namespace)

    def _pull_streamed(self, key: str, buf: PoolBuffer, timeout_s: float,
                       on_chunk: Callable[[int], None] | None, namespace: str
                       ) -> PendingPull | None:
        """Run one pull on a data connection (te_data_path socket).

        The pull on a data connection: the request, the reply and the item's bytes into
        `buf` on one socket, by the deadline; a failure on it fails the pull (`stream_error`)
        and closes that connection. A warm connection the producer had closed before reading
        the request is replaced once. None when the producer takes no data connection.
        Nothing but this thread writes into `buf`: never quarantined."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        request = Pull(pull_id=self.link.next_id(), key=key, session="", dst_addr=0,
                       capacity=buf.nbytes, namespace=namespace,
                       timeout_s=max(0.001, timeout_s))
        pending = PendingPull(buf, streamed=True)
        fresh = False
        while True:
            try:
                conn, reused = self.streams.acquire(deadline, fresh=fresh)
            except stream.StreamError as exc:
                pending.stream_error = f"stream from {self.endpoint}: {exc}"
                break
            if conn is None:
                return None
            pending.opened += not reused
            try:
                reply, _ = stream_client.pull(conn, request, buf, deadline, on_chunk)
            except stream.StreamClosed as exc:
                self.streams.release(conn, good=False)
                if reused and not fresh:
                    fresh = True
                    continue
                pending.stream_error = f"stream from {self.endpoint}: {exc}"
                break
            except (OSError, stream.StreamError) as exc:
                self.streams.release(conn, good=False)
                pending.stream_error = f"stream from {self.endpoint}: {exc}"
                break
            self.streams.release(conn, good=True)
            pending.finish(reply)
            return pending
        pending.finish()
        return pending

    def _open_stream(self, ticket: bytes) -> None:
        self.link.send(StreamOpen(ticket=ticket))

    def reap(self, ttl_s: float) -> None:
        """Close idle data connections; free quarantined buffers past `ttl_s`."""
        self.streams.reap()
        self.link.reap(ttl_s)

    @property
    def quarantined(self) -> int:
        """Buffers the side channel's pulls may still see written."""
        return self.link.quarantined

    def close(self) -> None:
        """Close the side channel and the data connections (busy ones when their pulls end)."""
        self.link.close()
        self.streams.close()
