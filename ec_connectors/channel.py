"""A generic ZMQ message channel owned by one background thread.

A generic ZMQ message channel: one end, owned by one background thread, that any thread may
`send` to (queued, then a doorbell pipe wakes the loop); optional CURVE (the deployment secret),
and a socket monitor that reports connects, lost connections and refused attempts.

Two wires ride it: the scheduler<->worker control channel (`control.py`, `messages.py`) and the
Mooncake TE peer side channel (`transports/mooncake_te/`). It knows neither: each user passes its
wire's `decode`; `encode` is shared (msgpack of a tagged msgspec struct: the tag travels with it,
so the wires differ only in what their decoders accept). Transports import this module, never a
role module.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from ec_connectors.log import get_logger
from ec_connectors.protocol.curve import CurveKeys

logger = get_logger(__name__)

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack of any tagged message, whichever wire it belongs to."""
    return _encoder.encode(msg)


class Channel:
    """One end of a ZMQ channel, owned by one background thread; any thread may `send`.

    `bind=True`: ROUTER (scheduler side, or a producer's peer server); `bind=False`: DEALER.
    `on_message(msg, peer, payload)` runs on the channel's thread: `peer` is the ROUTER
    identity of the sender (None on a DEALER), `payload` the raw frames after the header
    (inline item bytes on the peer channel). `decode` is the channel's wire; frames it
    rejects are counted and dropped. A DEALER reports a lost connection to `on_disconnect`
    (the peer process died), and a connection attempt that failed before any succeeded to
    `on_unreachable` (nobody listens there: refused). A DEALER's `greeting` is sent on every
    (re)connection (what a new connection must hear; it may trail messages queued before
    it). `curve`: the deployment's keys (protocol/curve.py); the socket is then a CURVE
    server (bound) or client (connecting), and peers without the secret cannot talk to it.
    """

    def __init__(
        self,
        address: str,
        bind: bool,
        on_message: Callable[[Any, bytes | None, list[bytes]], None],
        name: str,
        decode: Callable[[bytes], Any],
        on_disconnect: Callable[[], None] | None = None,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
        on_unreachable: Callable[[], None] | None = None,
        greeting: msgspec.Struct | None = None,
    ) -> None:
        self._curve = curve
        self._on_unreachable = on_unreachable
        self._greeting = greeting
        self.address = address
        self.bind = bind
        self._on_message = on_message
        self._decode = decode
        self._on_disconnect = on_disconnect
        self._ctx = context or zmq.Context.instance()
        self._outbox: deque[tuple[bytes | None, list[bytes | memoryview]]] = deque()
        self._bell_r, self._bell_w = os.pipe()
        os.set_blocking(self._bell_r, False)
        os.set_blocking(self._bell_w, False)
        self._stop = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.bad_frames = 0
        self.connected = False  # DEALER: a connection is (or was last seen) up
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError(f"EPD channel {address} did not start in 10 s")
        if self._error is not None:
            raise RuntimeError(f"EPD channel {address} failed: {self._error}")

    def send(self, msg: msgspec.Struct, to: bytes | None = None,
             payload: bytes | memoryview | None = None) -> None:
        frames: list[bytes | memoryview] = [encode(msg)]
        if payload is not None:
            frames.append(payload)
        self._outbox.append((to, frames))
        with contextlib.suppress(BlockingIOError):  # a full pipe: the loop is awake anyway
            os.write(self._bell_w, b"\0")

    def _open(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        sock = self._ctx.socket(zmq.ROUTER if self.bind else zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            (self._curve.server if self.bind else self._curve.client)(sock)
        # The monitor must exist before connect(): on loopback the connection can be up
        # before a later monitor attaches, and a missed CONNECTED hides every disconnect.
        mask = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        if self._on_unreachable is not None:
            mask |= zmq.EVENT_CONNECT_RETRIED
        monitor = (sock.get_monitor_socket(mask) if self._on_disconnect is not None
                   or self._on_unreachable or self._greeting is not None else None)
        if self.bind:
            path = self.address.removeprefix("ipc://")
            if self.address.startswith("ipc://") and os.path.exists(path):
                os.unlink(path)  # a stale socket from a dead process
            sock.bind(self.address)
        else:
            sock.connect(self.address)
        return sock, monitor

    def _run(self) -> None:
        try:
            sock, monitor = self._open()
        except BaseException as exc:  # surfaced to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._bell_r, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop:
                events = dict(poller.poll(500))
                if self._bell_r in events:
                    try:
                        while os.read(self._bell_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                while self._outbox:
                    to, frames = self._outbox.popleft()
                    if not self.bind:
                        sock.send_multipart(frames)
                    elif to is not None:
                        sock.send_multipart([to, *frames])
                if monitor is not None and monitor in events:
                    self._on_monitor(monitor)
                if sock in events:
                    self._receive(sock)
        finally:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close()
            sock.close()

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                self.connected = True
                if self._greeting is not None:
                    self.send(self._greeting)
                continue
            if kind == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                handler = self._on_disconnect
            elif kind == zmq.EVENT_CONNECT_RETRIED and not self.connected:
                handler = self._on_unreachable
            else:
                continue
            if handler is not None:
                try:
                    handler()
                except Exception:
                    logger.exception("EPD channel %s: connection handler failed", self.address)

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer = frames[0] if self.bind else None
            body = frames[1:] if self.bind else frames
            try:
                if not body:
                    raise msgspec.DecodeError("empty message")
                msg = self._decode(body[0])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.bad_frames += 1
                logger.warning("EPD channel %s: dropped a malformed message: %s",
                               self.address, exc)
                continue
            try:
                self._on_message(msg, peer, body[1:])
            except Exception:
                logger.exception("EPD channel %s: handler failed for %r", self.address, msg)

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._bell_w, b"\0")
        self._thread.join(timeout=5)
        for fd in (self._bell_r, self._bell_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.bind and self.address.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(self.address.removeprefix("ipc://"))
