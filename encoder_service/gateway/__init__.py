"""Gateway: one OpenAI-compatible endpoint in front of every EPD instance.

The EPD gateway: one OpenAI-compatible endpoint in front of encoders and prefill/decode
instances. Read `app.py`, then `requests/chat.py`.

- `app.py`: the ASGI app: routes, wiring, lifecycle; each part gets its own config section.
  `server.py`: run it (blocking or on a thread); `cli.py`: `epd gateway`.
- `config.py`: every setting, validated, in sections. `auth.py`: API keys both ways.
  `wire.py`: the one JSON codec and the client-facing error.
- `admin.py`: the control plane: /health, /instances, /admin/instances.
  `member_cli.py`: `epd member join|leave`, an instance's own hooks (Kubernetes postStart /
  preStop) into that admin API.
- `requests/`: the request path: admission, one chat request, the answer relayed back.
- `media/`: media checks, URL fetches and content-derived item ids.
- `upstreams/`: encoders, prefill and decode instances: routing, clients, health, failover.
- `telemetry/`: Prometheus metrics, OpenTelemetry traces and their export, `epd top`.
"""

from encoder_service.gateway.app import create_app
from encoder_service.gateway.config import GatewayConfig, GatewayConfigError

__all__ = ["GatewayConfig", "GatewayConfigError", "create_app"]
