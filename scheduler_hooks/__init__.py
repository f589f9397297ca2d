"""The scheduler-side policy of EPDConnector as pure logic over plain values: the
availability index (`index.py`), the deferral state machine with its transition table
(`staging.py`), readiness and failure decisions (`decisions.py`). It imports nothing from
`ec_connectors/` and no vLLM: `ec_connectors/scheduler.py` wires it to vLLM's scheduler API,
the control channel and the transports."""
