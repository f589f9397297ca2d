"""The wire protocol every EPD process shares: torch-free formats, no running machinery.

The gateway, the encoder pool and the connector's roles all import it; it imports nothing of
the project but `epd_common`.

- `params.py`: the `ec_transfer_params` a producer returns and a consumer accepts, typed.
- `keys.py`: item ids -> safe storage keys, content-derived item ids.
- `stored.py`: `ItemInfo` (one stored item), transport names, stored items' file names.
- `ports.py`: the port plan.
- `secret.py`: the deployment secret (CURVE keys, seals, signed ids, API key, admin token).
- `fingerprint.py`: a model's weights and config, in every item's scope.
- `http_api.py`: what every EPD HTTP server shares (error types, the bearer key check, the
  video frame-list format).
- `refusals.py`: a refusal's reason, posted by EngineCore and answered by the API server.
"""
