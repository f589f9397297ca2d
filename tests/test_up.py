"""`epd up` without vLLM: config validation and the checks that fail fast before minutes of
vLLM start-up. (Starting and stopping a real deployment: tests/test_gateway_e2e.py.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from encoder_service.up import Deployment, UpConfig, UpError, load_up_config

from .conftest import ROOT


def test_defaults_and_clear_errors(tmp_path):
    cfg = load_up_config(None)
    assert (cfg.encoders, cfg.decoders, cfg.base_port, cfg.transport) == (1, 1, 18100,
                                                                          "safetensors")
    bad = tmp_path / "up.json"
    bad.write_text(json.dumps({"encoder": 2}))
    with pytest.raises(UpError, match="encoder: Extra inputs"):
        load_up_config(bad)
    bad.write_text(json.dumps({"decoders": 0}))
    with pytest.raises(UpError, match="decoders"):
        load_up_config(bad)
    toml = tmp_path / "up.toml"
    toml.write_text('encoders = 2\n[gateway.limits]\nmax_media_items = 4\n')
    cfg = load_up_config(toml)
    assert cfg.encoders == 2 and cfg.gateway == {"limits": {"max_media_items": 4}}


def test_plan_wires_ports_cores_and_the_gateway(tmp_path):
    dep = Deployment(UpConfig(encoders=2, decoders=1, base_port=18510, cpu_cores=[0, 1, 1],
                              storage_path=str(tmp_path / "ec"),
                              gateway={"limits": {"max_media_items": 4}}), tmp_path)
    dep.plan(tmp_path / "model")
    assert [s.port for s in dep.servers] == [18511, 18512, 18513]
    assert [s.cpu_core for s in dep.servers] == [0, 1, 1]
    assert [s.ec_config["ec_role"] for s in dep.servers] == ["ec_producer"] * 2 + ["ec_consumer"]
    g = dep.gateway_cfg
    assert g.port == 18510 and g.encoders == [dep.servers[0].url, dep.servers[1].url]
    assert g.availability.storage_path == str(tmp_path / "ec")
    assert g.limits.max_media_items == 4
    with pytest.raises(UpError, match="cpu_cores lists 1"):
        Deployment(UpConfig(cpu_cores=[0]), tmp_path).plan(tmp_path / "model")
    with pytest.raises(UpError, match="max_media_itemz"):
        Deployment(UpConfig(gateway={"limits": {"max_media_itemz": 1}}),
                   tmp_path).plan(tmp_path / "m")


def test_a_taken_port_fails_fast_with_no_server_started():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 18517))
        taken.listen()
        r = subprocess.run([sys.executable, "-m", "encoder_service.cli", "up", "--base-port",
                            "18515"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "port 18517" in r.stdout and "not free" in r.stdout
    assert "starting encoder" not in r.stdout
