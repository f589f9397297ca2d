"""The workers connected to the scheduler over the control channel.

Each worker says `Hello` when it joins (again after a reconnect): its rank, and, on a
producer that serves items itself, where it serves them. The control channel's thread
records them; the scheduler's thread asks who is there and sends to all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ec_connectors.control.messages import ControlMessage, Hello
from ec_connectors.log import get_logger

logger = get_logger(__name__)


class WorkerRoster:
    """Ranks -> control-channel peers and item endpoints; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[int, bytes] = {}
        self._endpoints: dict[int, str] = {}  # rank -> where it serves items

    def hello(self, msg: Hello, peer: bytes | None) -> None:
        with self._lock:
            self._peers[msg.rank] = peer or b""
            if msg.endpoint:
                self._endpoints[msg.rank] = msg.endpoint
        logger.info("EPD: worker rank %d (pid %d) connected%s", msg.rank, msg.pid,
                    f", serving items at {msg.endpoint}" if msg.endpoint else "")

    def ranks(self) -> set[int]:
        with self._lock:
            return set(self._peers)

    def __len__(self) -> int:
        with self._lock:
            return len(self._peers)

    def endpoint(self) -> str:
        """Where the lowest rank serves items ("" when no worker serves them)."""
        with self._lock:
            return self._endpoints[min(self._endpoints)] if self._endpoints else ""

    def broadcast(self, msg: ControlMessage,
                  send: Callable[[ControlMessage, bytes], None]) -> None:
        """`msg` to every worker, through `send(msg, peer)`."""
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            send(msg, peer)
