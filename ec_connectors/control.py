"""Scheduler <-> worker control channel over ZMQ unix sockets.

Why a channel of our own: vLLM's V1 model runner skips all connector code on a step with zero
scheduled tokens, which is exactly what a deferred request produces when nothing else runs. So
prefetch commands and their completions must not ride only on SchedulerOutput / worker output.
The scheduler binds a ROUTER; each worker connects a DEALER. One background thread per side
owns its socket; any thread may `send` (queued, then a doorbell pipe wakes the loop).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from ec_connectors import messages
from ec_connectors.log import get_logger
from ec_connectors.messages import ControlMessage

logger = get_logger(__name__)


def control_address(control_dir: str, engine_id: str, dp_rank: int) -> str:
    # Unix socket paths are limited to ~107 bytes: name the socket by a digest.
    Path(control_dir).mkdir(parents=True, exist_ok=True)
    tag = hashlib.blake2b(f"{engine_id}/{dp_rank}".encode(), digest_size=10).hexdigest()
    return f"ipc://{os.path.join(control_dir, f'epd-{tag}.sock')}"


class ControlEndpoint:
    """One end of the channel. `bind=True` (scheduler, ROUTER) or False (worker, DEALER).

    `on_message(msg, peer)` runs on the endpoint's thread; `peer` is the ROUTER identity of
    the sender (None on the worker side). Malformed frames are logged and dropped.
    """

    def __init__(
        self,
        address: str,
        bind: bool,
        on_message: Callable[[ControlMessage, bytes | None], None],
        name: str,
    ) -> None:
        self.address = address
        self.bind = bind
        self._on_message = on_message
        self._ctx = zmq.Context.instance()
        self._outbox: deque[tuple[bytes | None, bytes]] = deque()
        self._bell_r, self._bell_w = os.pipe()
        os.set_blocking(self._bell_r, False)
        os.set_blocking(self._bell_w, False)
        self._stop = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.bad_frames = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError(f"EPD control endpoint {address} did not start in 10 s")
        if self._error is not None:
            raise RuntimeError(f"EPD control endpoint {address} failed: {self._error}")

    def send(self, msg: ControlMessage, to: bytes | None = None) -> None:
        self._outbox.append((to, messages.encode(msg)))
        with contextlib.suppress(BlockingIOError):  # a full pipe: the loop is awake anyway
            os.write(self._bell_w, b"\0")

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER if self.bind else zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if self.bind:
                path = self.address.removeprefix("ipc://")
                if os.path.exists(path):
                    os.unlink(path)  # a stale socket from a dead process
                sock.bind(self.address)
            else:
                sock.connect(self.address)
        except BaseException as exc:  # surfaced to the constructor
            self._error = exc
            self._ready.set()
            sock.close()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._bell_r, zmq.POLLIN)
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
                    to, data = self._outbox.popleft()
                    if self.bind:
                        if to is not None:
                            sock.send_multipart([to, data])
                    else:
                        sock.send(data)
                if sock in events:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        peer = frames[0] if self.bind else None
                        try:
                            msg = messages.decode(frames[-1])
                        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                            self.bad_frames += 1
                            logger.warning("EPD control: dropped a malformed message: %s", exc)
                            continue
                        try:
                            self._on_message(msg, peer)
                        except Exception:
                            logger.exception("EPD control: handler failed for %r", msg)
        finally:
            sock.close()

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._bell_w, b"\0")
        self._thread.join(timeout=5)
        for fd in (self._bell_r, self._bell_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.bind:
            path = self.address.removeprefix("ipc://")
            with contextlib.suppress(OSError):
                os.unlink(path)
