"""The connector is reachable by bare name (entry point) and by module path."""

from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

from ec_connectors.connector import EPDConnector


def test_entry_point_registers_the_bare_name():
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    load_general_plugins()  # idempotent
    cfg = ECTransferConfig(ec_connector="EPDConnector", ec_role="ec_consumer")
    assert ECConnectorFactory.get_connector_class(cfg) is EPDConnector


def test_module_path_works():
    cfg = ECTransferConfig(ec_connector="EPDConnector", ec_role="ec_producer",
                           ec_connector_module_path="ec_connectors.connector")
    assert ECConnectorFactory.get_connector_class(cfg) is EPDConnector


def test_stats_round_trip_through_vllm_hooks():
    stats = EPDConnector.build_ec_connector_stats({"counters": {"loads": 2},
                                                   "latency": {"load_s": [0.001, 0.003]}})
    other = EPDConnector.build_ec_connector_stats({"counters": {"loads": 1, "saves": 4}})
    summary = stats.aggregate(other).reduce()
    assert summary["loads"] == 3 and summary["saves"] == 4
    assert summary["load_s_p50_ms"] == 3.0
