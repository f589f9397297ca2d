"""Transport names, the one list every process and config checks against (torch-free).

`TransportName`: what `ec_connector_extra_config.transport` accepts (one name, or a list of
them as tiers). `UpTransport`: what `epd up --transport` accepts: one transport, or the
`tiered` preset, whose tiers are `TIERED` in load order (the producer's pool, then the
store, then the shared directory), or `auto`: `shm` (same-host shared memory) when every
server runs on this host, which is always so for `epd up`.
"""

from __future__ import annotations

from typing import Literal, get_args

TransportName = Literal["safetensors", "mooncake", "mooncake_store", "shm"]
TRANSPORT_NAMES: tuple[TransportName, ...] = get_args(TransportName)
UpTransport = Literal[TransportName, "tiered", "auto"]
TIERED: tuple[TransportName, ...] = ("mooncake", "mooncake_store", "safetensors")
