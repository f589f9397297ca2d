"""EPD connectors: vLLM encoder-cache connectors and their transports.

vLLM encoder-cache connectors (EPDConnector) and their transports, grouped by the process
each part runs in. Start at `connector.py`.

All vLLM processes:
- `connector.py`: `EPDConnector`, vLLM's EC connector: a thin delegate to the SCHEDULER role
  (`sched/`) and the WORKER role (`workers/`).
- `plugin.py`: the `vllm.general_plugins` entry point (the bare name `EPDConnector`).
- `config.py`: `EPDConfig`, every key of `ec_connector_extra_config`, validated in one place.
- `placeholders.py`: vLLM's placeholder metadata per model (what a producer publishes, which
  items are metadata-only on a consumer).
- `stats.py`: counters, gauges and histograms (vLLM's log lines and Prometheus).
- `log.py`: loggers under vLLM's.
Per process:
- `guard/`: the vLLM API server's middleware (`server_guard.py` keeps the `--middleware`
  path `ec_connectors.server_guard.ServerGuard` stable).
- `sched/`: the SCHEDULER role, in EngineCore. `workers/`: the WORKER role, in each worker.
- `control/`: the scheduler <-> worker wire between them.
Shared below them:
- `transports/`: one small interface, several backends (safetensors, shm, Mooncake TE and
  Store, tiers). `channel.py`: a ZMQ message channel (one owner thread, doorbell, monitor,
  CURVE) under the control wire and the Mooncake TE side channel. `protocol/`: the wire
  protocol every EPD process shares.
"""

__version__ = "0.1.0"
