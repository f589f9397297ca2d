"""One port scheme (ec_connectors/protocol/ports.py): every command and config agrees on it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ec_connectors.config import EPDConfig
from ec_connectors.protocol import ports
from ec_connectors.transports.engine_ports import local_fixed_ports, plan_engine_ports
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


# --- the Mooncake engines' own range (ports.engine_ports, ports.engine_env) ---------------

def _bounds(model, name: str) -> tuple[int, int]:
    meta = model.model_fields[name].metadata
    return (next(m.ge for m in meta if getattr(m, "ge", None) is not None),
            next(m.le for m in meta if getattr(m, "le", None) is not None))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data(), transport=st.sampled_from(["mooncake", "mooncake_store", "tiered"]))
def test_the_engine_range_excludes_every_fixed_port_of_any_epd_up_it_accepts(data, transport):
    """For every base port, Mooncake base port, master port and instance count `epd up`
    accepts (UpConfig's own bounds), the engines' range holds no fixed port of the
    deployment, spans ENGINE_SPAN ports below the kernel's ephemeral ones, and `epd up`
    hands it to every Mooncake process."""
    values = {name: data.draw(st.integers(*_bounds(UpConfig, name)), label=name)
              for name in ("base_port", "mooncake_base_port", "master_port", "encoders",
                           "decoders")}
    cfg = UpConfig(transport=transport, **values)
    fixed = cfg.fixed_ports
    env = ports.engine_env(fixed, {})
    first, last = int(env[ports.ENGINE_MIN_ENV]), int(env[ports.ENGINE_MAX_ENV])
    assert last - first + 1 == ports.ENGINE_SPAN
    assert ports.ENGINE_FLOOR <= first < last <= ports.ENGINE_CEILING < 32768
    assert not [p for p in fixed if first <= p <= last]
    # every port the deployment binds is a fixed port of the plan
    n = cfg.encoders + cfg.decoders
    bound = {cfg.base_port, *(cfg.base_port + 1 + i for i in range(n))}
    if cfg.uses_te:
        bound |= {p for i in range(cfg.encoders) for p in ports.producer_ports(
            ports.encoder_base_port(cfg.mooncake_base_port, i))}
    if cfg.uses_store:
        bound |= set(ports.master_ports(cfg.master_port))
    assert bound <= set(fixed)
    # and no server refuses the range it is given: the ports each one knows are fixed ports
    # of the plan or a default deployment's
    for role, i in [*(("ec_producer", i) for i in range(cfg.encoders)), ("ec_consumer", 0)]:
        c = EPDConfig.from_dict(connector_extra(cfg, role, i))
        assert set(local_fixed_ports(c)) <= set(fixed) | ports.DEFAULT_FIXED, (role, i)
        assert plan_engine_ports(c, "not.imported", dict(env)) == (first, last)


def test_every_fixed_port_of_a_deployment_is_the_plans(tmp_path):
    """What Deployment.plan starts (servers, side channels, master) is in `fixed_ports`, and
    every Mooncake process gets the plan's range."""
    from encoder_service.local.up import Deployment

    cfg = UpConfig(encoders=3, decoders=2, base_port=25010, transport="tiered",
                   mooncake_base_port=14000, master_port=24990)
    dep = Deployment(cfg, tmp_path)
    dep.plan(tmp_path / "model")
    assert {s.port for s in dep.servers} | {cfg.base_port} <= set(cfg.fixed_ports)
    assert dep.master is not None
    assert set(ports.master_ports(dep.master.port)) <= set(cfg.fixed_ports)
    # 24990-24992 and 25010-25015 are fixed: the default 25000-25999 is not clear
    envs = [s.env for s in [*dep.servers, dep.master]]
    assert {(e[ports.ENGINE_MIN_ENV], e[ports.ENGINE_MAX_ENV]) for e in envs} == {
        ("10000", "10999")}
    assert dep.engine_ports == ("10000", "10999")


def test_a_users_engine_range_that_holds_a_fixed_port_is_refused_naming_them(tmp_path):
    from encoder_service.local.up import Deployment
    from encoder_service.local.up_config import UpError

    fixed = UpConfig(encoders=2, transport="mooncake").fixed_ports
    assert ports.engine_env(fixed, {}) == {"MC_MIN_RPC_PORT": "25000",
                                           "MC_MAX_RPC_PORT": "25999"}
    mine = {"MC_MIN_RPC_PORT": "30000", "MC_MAX_RPC_PORT": "30100"}
    assert ports.engine_env(fixed, mine) == mine  # clear of them: kept
    with pytest.raises(ValueError) as err:  # Mooncake's own default: the side channels
        ports.engine_env(fixed, {"MC_MIN_RPC_PORT": "15000", "MC_MAX_RPC_PORT": "17000"})
    msg = str(err.value)
    assert "15000-17000" in msg and "15500-15509 (encoder 0's side channel)" in msg
    assert "16510-16519 (encoder 1's side channel)" in msg and "25000-25999" in msg
    for bad in ({"MC_MIN_RPC_PORT": "26000"}, {"MC_MIN_RPC_PORT": "x", "MC_MAX_RPC_PORT": "1"},
                {"MC_MIN_RPC_PORT": "27000", "MC_MAX_RPC_PORT": "27000"}):
        with pytest.raises(ValueError, match="MC_MIN_RPC_PORT"):
            ports.engine_env(fixed, bad)
    with pytest.MonkeyPatch.context() as mp:  # `epd up` refuses it before starting anything
        mp.setenv("MC_MIN_RPC_PORT", "18000")
        mp.setenv("MC_MAX_RPC_PORT", "18200")
        with pytest.raises(UpError, match=r"18100 \(the gateway\)"):
            Deployment(UpConfig(transport="mooncake"), tmp_path).plan(tmp_path / "model")


def test_a_process_started_by_hand_plans_around_the_ports_it_knows():
    """A worker outside `epd up` (README, compose, k8s, tests) puts the plan's range in its
    environment before importing mooncake: clear of its own side channels, of local
    producers and a local store master; a set range overlapping them is refused."""
    from ec_connectors.transports.engine_ports import EngineRangeError

    env: dict[str, str] = {}
    cfg = EPDConfig(transport="mooncake", host="127.0.0.1", base_port=24800)
    assert plan_engine_ports(cfg, "not.imported", env) == (10000, 10999)  # 24800-27799 held
    assert env == {"MC_MIN_RPC_PORT": "10000", "MC_MAX_RPC_PORT": "10999"}
    env = {}
    assert plan_engine_ports(EPDConfig(transport="mooncake"), "not.imported", env) == (
        25000, 25999)
    consumer = EPDConfig(transport=["mooncake", "mooncake_store"], host="127.0.0.1",
                         producers=["127.0.0.1:25500", "10.1.1.1:25600"],
                         store_master="localhost:25700")
    with pytest.raises(EngineRangeError) as err:
        plan_engine_ports(consumer, "not.imported", {"MC_MIN_RPC_PORT": "25400",
                                                     "MC_MAX_RPC_PORT": "25799"})
    msg = str(err.value)
    assert "25500 (producer 127.0.0.1:25500)" in msg and "25700-25702 (the store master)" in msg
    assert "25600" not in msg  # another host's port is no collision here


def test_a_bind_failure_names_the_process_holding_the_port():
    from epd_common.net import holders, port_holder

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert port_holder(port) == ""  # bound, not listening
        s.listen()
        assert port_holder(port).startswith(f"pid {os.getpid()} (")
        assert holders([port]).startswith(f"port {port} is held by pid {os.getpid()}")


def test_no_benchmark_or_deployment_setting_names_a_port_in_the_default_engine_range():
    """The benchmarks' and deployment files' fixed ports stay out of ENGINE_PORTS, which
    their Mooncake processes draw from (the tests' own ports: tests/test_port_blocks.py)."""
    first, last = ports.ENGINE_PORTS
    files = [*(ROOT / "benchmarks").rglob("*.py"), ROOT / "deploy" / "settings.toml"]
    assert len(files) > 10  # the benchmarks are found where they are
    hits = [(str(f.relative_to(ROOT)), n) for f in files
            for n in map(int, re.findall(r"\b\d{5}\b", f.read_text())) if first <= n <= last]
    assert not hits


def test_compose_and_k8s_give_every_mooncake_process_the_plans_range():
    """The Store clients' engines (encoder, prefill/decode; E/P/D's prefill and decode) and
    the master get the plan's range, clear of the files' fixed ports (vLLM, gateway, the
    master's three, the KV side channels)."""
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    k8s = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "epd.yaml").read_text()))
    envs = {f"compose/{n}": compose[n]["environment"]
            for n in ("encoder", "prefill-decode", "mooncake-master", "prefill", "decode")}
    for doc in k8s:
        if doc and doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["name"] != "gateway":
                    envs[f"k8s/{doc['metadata']['name']}"] = {
                        e["name"]: e.get("value") for e in c.get("env", [])}
    assert len(envs) == 10, sorted(envs)
    fixed = [8000, *ports.master_ports(ports.MASTER_RPC_PORT)]
    plan = ports.engine_env(fixed, {})
    for name, env in envs.items():
        assert {k: env.get(k) for k in plan} == plan, name
