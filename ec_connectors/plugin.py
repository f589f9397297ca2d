"""vLLM plugin (`vllm.general_plugins` entry point): makes `"ec_connector": "EPDConnector"`
work with no module path. vLLM calls this in every process (API server, engine, workers)."""

from __future__ import annotations

CONNECTOR_NAME = "EPDConnector"


def register() -> None:
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    if CONNECTOR_NAME not in ECConnectorFactory._registry:  # idempotent: called per process
        ECConnectorFactory.register_connector(
            CONNECTOR_NAME, "ec_connectors.connector", "EPDConnector"
        )
