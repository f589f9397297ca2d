"""The guard: checks in front of a vLLM server's HTTP API.

The guard in front of a vLLM server's HTTP API, in vLLM's API-server process
(`--middleware ec_connectors.server_guard.ServerGuard`). Torch-free.

- `server_guard.py`: `ServerGuard`, the ASGI middleware: the deployment key on every route,
  bounds before allocation, a reason on every refusal.
- `request_checks.py`: the bounds a body is checked against before vLLM parses it.
- `item_ids.py`: items keep their EPD id as vLLM's name on servers with media settings.
"""
