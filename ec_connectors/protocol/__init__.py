"""The wire protocol every EPD process shares: torch-free formats, no running machinery.

The gateway, the encoder pool and the connector's roles all import it; it imports nothing of
the project but `epd_common`.

- `params.py`: the `ec_transfer_params` a producer returns and a consumer accepts, typed.
- `keys.py`: item ids -> safe storage keys, content-derived item ids.
- `stored.py`: `ItemInfo` (one stored item), transport names, stored items' file names.
- `ports.py`: the port plan.
- `secret_file.py`: the deployment secret, read from its file, and the keys derived from it.
- `curve.py`: the data plane's CURVE key pairs, and its host (loopback) without a secret.
- `seal.py`: `Seal`, stored objects authenticated with the secret.
- `item_ids.py`: `IdSigner` (the item ids a deployment vouches for) and a stored item's
  `identity`.
- `api_keys.py`: the API key of the deployment's servers and the admin token.
- `fingerprint.py`: a model's weights and config, in every item's scope.
- `http_api.py`: what every EPD HTTP server shares (error types, the bearer key check, the
  video frame-list format).
- `refusals.py`: a refusal's reason, posted by EngineCore and answered by the API server.
"""
