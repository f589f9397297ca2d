"""The EPD gateway: one OpenAI-compatible endpoint in front of encoders and prefill/decode
instances. Read `app.py`, then `chat.py`.

- `app.py`: the ASGI app: routes, wiring, lifecycle. `server.py`: run it (blocking or on a
  thread); `cli.py`: `epd gateway`. `config.py`: every setting, validated.
- `admission.py`: the door (request ids, concurrency slots, bounded body reads); `auth.py`:
  API keys both ways; `codec.py`: the one JSON codec; `errors.py`: client-facing errors.
- `chat.py`: one chat request: items, overlap, the decode request.
- `parsing.py` + `media.py` + `urls.py`: media checks and content-derived item ids.
- `availability.py`: items already stored somewhere (skip their encode).
- `routing.py`: rendezvous hashing with bounded loads; `encoder_clients.py` + `coalescing.py`:
  encoders and the router that gives each item one encode; `decoders.py`: prefill/decode
  instances; `kv_handoff.py`: E/P/D, the prefill hop whose KV cache a decode instance loads.
- `relay.py`: the answer back; `failover.py` (pure) + `resume.py` (I/O): a broken stream
  continued on another instance.
- `probes.py`: health probes with a real forward; `outages.py`: instances a supervisor
  (`epd up`) reports down and back; `admin.py`: /health, /instances, /admin/instances;
  `metrics.py`: Prometheus; `top.py`: `epd top`, a live view of a deployment from its
  gateway's /metrics and /instances.
- `tracing.py`: OpenTelemetry traces of chat requests (off unless configured), traceparent to
  every upstream; `otlp.py`: their OTLP/HTTP export (protobuf encoded here).
"""

from encoder_service.gateway.app import create_app
from encoder_service.gateway.config import GatewayConfig, GatewayConfigError

__all__ = ["GatewayConfig", "GatewayConfigError", "create_app"]
