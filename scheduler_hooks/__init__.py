"""The scheduler-side policy of EPDConnector as pure logic over plain values (no threads, no
I/O): the deferral state machine with its transition table (`staging.py`), the consumer's
per-item plan and its readiness and failure decisions (`decisions.py`), what vLLM's own
encoder cache holds (`encoder_cache.py`), the feature lifecycle with its transition table and
bytes per state (`lifecycle.py`). It imports nothing from `ec_connectors/` and no
vLLM: `ec_connectors/sched/scheduler.py` wires it to vLLM's scheduler API, the control channel, the
transports and the availability index (`ec_connectors/sched/index.py`)."""
