"""Scheduler <-> worker control channel over ZMQ unix sockets.

Why a channel of our own: vLLM's V1 model runner skips all connector code on a step with zero
scheduled tokens, which is exactly what a deferred request produces when nothing else runs. So
prefetch commands and their completions must not ride only on SchedulerOutput / worker output.
The scheduler binds a ROUTER; each worker connects a DEALER. The channel itself (one thread per
side, doorbell, monitor, CURVE) is the generic `channel.Channel`; this module adds the address
scheme and the control wire (`messages.py`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ec_connectors.channel import Channel
from ec_connectors.control import messages


def control_address(control_dir: str, engine_id: str, dp_rank: int) -> str:
    # Unix socket paths are limited to ~107 bytes: name the socket by a digest.
    Path(control_dir).mkdir(parents=True, exist_ok=True)
    tag = hashlib.blake2b(f"{engine_id}/{dp_rank}".encode(), digest_size=10).hexdigest()
    return f"ipc://{os.path.join(control_dir, f'epd-{tag}.sock')}"


class ControlEndpoint(Channel):
    """One end of the scheduler<->worker control channel.

    One end of the scheduler<->worker control channel: a Channel on the control wire
    (messages.ControlMessage). The scheduler binds (ROUTER), each worker connects (DEALER)."""

    def __init__(self, address: str, bind: bool,
                 on_message: Callable[[Any, bytes | None, list[bytes]], None], name: str
                 ) -> None:
        super().__init__(address, bind, on_message, name, decode=messages.decode)
