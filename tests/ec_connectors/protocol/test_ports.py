"""One port scheme (ec_connectors/protocol/ports.py): every command and config agrees on it."""

from __future__ import annotations

import subprocess
import sys

from ec_connectors.config import EPDConfig
from ec_connectors.protocol import ports
from encoder_service.gateway.config import GatewayConfig
from encoder_service.local.mooncake_master import master_server
from encoder_service.local.up_config import UpConfig, connector_extra, mooncake_endpoint
from tests.helpers import ROOT


def test_defaults_follow_the_port_scheme(tmp_path):
    up = UpConfig()
    assert up.base_port == ports.GATEWAY_PORT == 18100
    assert GatewayConfig.build({"decoders": ["http://d"]}).port == up.base_port
    assert up.mooncake_base_port == EPDConfig().base_port == ports.MOONCAKE_BASE_PORT == 15500
    assert up.master_port == ports.MASTER_RPC_PORT == 50051
    m = master_server(tmp_path)
    assert (m.port, m.http_port, m.metrics_port) == (50051, 50052, 50053)
    # a client that names only the master finds its metadata server at RPC + 1
    assert EPDConfig().store_metadata_url == m.metadata_url
    assert EPDConfig(store_master="master.epd:6000").store_metadata_url == (
        "http://master.epd:6001/metadata")
    assert EPDConfig(store_metadata="http://x:1/metadata").store_metadata_url == (
        "http://x:1/metadata")


def test_epd_up_wiring_uses_the_scheme():
    cfg = UpConfig(encoders=3, transport="tiered", mooncake_base_port=16000, master_port=17000)
    assert [mooncake_endpoint(cfg, i) for i in range(3)] == [
        "127.0.0.1:16000", "127.0.0.1:16010", "127.0.0.1:16020"]
    extra = connector_extra(cfg, "ec_producer", 2)
    assert extra["base_port"] == ports.encoder_base_port(16000, 2) == 16020
    assert extra["store_metadata"] == "http://127.0.0.1:17001/metadata"
    assert ports.announce_endpoint("h:16020") == "h:17020"
    assert ports.port_for(16020, ports.PURPOSE_ANNOUNCE, 0, 0, 1, 0) == 17020
    assert ports.stream_port(16020) == ports.port_for(16020, ports.PURPOSE_STREAM, 0, 0, 1, 0) \
        == 18020


def test_every_purpose_fits_the_highest_base_port():
    top = EPDConfig.model_fields["base_port"].metadata
    highest = next(m.le for m in top if getattr(m, "le", None) is not None)
    assert ports.port_for(highest, ports.PURPOSE_STREAM, ports.MAX_RANKS_PER_NODE - 1, 0, 1,
                          0) == 65535


def test_command_lines_state_the_defaults():
    def help_of(*cmd: str) -> str:
        r = subprocess.run([sys.executable, "-m", "encoder_service.cli", *cmd, "--help"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return " ".join(r.stdout.split())

    assert "default 18100" in help_of("gateway")
    assert "default 18100" in help_of("up") and "default 18100" in help_of("demo")
    master = help_of("master")
    assert "default 50051" in master and "RPC port + 1" in master and "RPC port + 2" in master
