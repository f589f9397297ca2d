"""The torch-free formats every EPD process shares (the gateway and the encoder pool import
this layer and transports; the connector's roles import it too). It imports nothing of the
project above it.

- `params.py`: the `ec_transfer_params` a producer returns and a consumer accepts, typed.
- `keys.py`: item ids -> safe storage keys, content-derived item ids.
- `items.py`: `ItemInfo`, one stored item's description (shape, dtype, checksum, where).
- `storage_names.py`: file suffixes of the stored items (safetensors, shm records).
- `names.py`: transport names. `net.py`: hosts and endpoints. `ports.py`: the port plan.
- `secret.py`: the deployment secret (CURVE keys, seals, signed ids, API key, admin token).
- `fingerprint.py`: a model's weights and config, in every item's scope.
- `http_api.py`: what every EPD HTTP server shares (error types, the bearer key check).
- `refusals.py`: a refusal's reason, posted by EngineCore and answered by the API server.
- `channel.py`: a generic ZMQ channel (one owner thread, doorbell, monitor, CURVE) for the
  control wire and the Mooncake TE side channel.
- `lru.py`: `BoundedLRU`.
- `frame_lists.py`: a video as vLLM's comma-joined list of base64 frames.
"""
