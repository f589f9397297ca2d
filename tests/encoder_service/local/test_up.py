"""`epd up` without vLLM (up.py): what a deployment plans to start, and the checks that fail
fast before minutes of vLLM start-up. (The config alone: test_up_config.py. Starting and
stopping a real deployment: tests/e2e/test_up.py and tests/e2e/test_gateway.py.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from ec_connectors.config import EPDConfig
from ec_connectors.protocol import ports
from encoder_service.local import up_config
from encoder_service.local.up import Deployment
from encoder_service.local.up_config import UpConfig, UpError, load_up_config
from epd_common.child_process import die_with_parent
from tests.helpers import MASTER, MOONCAKE, ROOT, port_block

# the ports of the deployments this module checks or lets `epd up` check (it starts none): a
# gateway and its servers from UP, a Mooncake side channel, a store master; plans that bind
# nothing name any port
UP, MC = port_block(__name__)[0], port_block(__name__, MOONCAKE)[0]
STORE_MASTER = port_block(__name__, MASTER)[0]  # 19960-19962

# a Mooncake server's environment without a deployment secret: loopback, no API key
# the port plan's engine range (ports.ENGINE_PORTS: clear of this module's ports)
ENGINE_ENV = {"MC_MIN_RPC_PORT": str(ports.ENGINE_PORTS[0]),
              "MC_MAX_RPC_PORT": str(ports.ENGINE_PORTS[1])}
NO_SECRET_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "VLLM_API_KEY": "", **ENGINE_ENV}


def test_plan_wires_ports_cores_and_the_gateway(tmp_path):
    dep = Deployment(UpConfig(encoders=2, decoders=1, base_port=18510, cpu_cores=[0, 1, 1],
                              storage_path=str(tmp_path / "ec"), transport="safetensors",
                              gateway={"limits": {"max_media_items": 4}}), tmp_path)
    dep.plan(tmp_path / "model")
    assert [s.port for s in dep.servers] == [18511, 18512, 18513]
    assert [s.cpu_core for s in dep.servers] == [0, 1, 1]
    assert [s.ec_config["ec_role"] for s in dep.servers] == ["ec_producer"] * 2 + ["ec_consumer"]
    g = dep.gateway_cfg
    assert g.port == 18510 and g.encoders == [dep.servers[0].url, dep.servers[1].url]
    assert g.availability.storage_path == str(tmp_path / "ec")
    assert g.limits.max_media_items == 4 and g.routing.coalesce_items == 8
    one = Deployment(UpConfig(vllm_args=["--limit-mm-per-prompt", '{"image": 1}']), tmp_path)
    one.plan(tmp_path / "model")  # vLLM takes one image per prompt: no shared calls
    assert one.gateway_cfg.routing.coalesce_items == 1
    with pytest.raises(UpError, match="cpu_cores lists 1"):
        Deployment(UpConfig(cpu_cores=[0]), tmp_path).plan(tmp_path / "model")
    with pytest.raises(UpError, match="max_media_itemz"):
        Deployment(UpConfig(gateway={"limits": {"max_media_itemz": 1}}),
                   tmp_path).plan(tmp_path / "m")


def test_plan_epd_gives_prefill_and_decode_instances_the_kv_connector(tmp_path):
    dep = Deployment(UpConfig(decoders=1, prefills=2, base_port=18510, transport="safetensors",
                              kv_transfer={"kv_buffer_device": "cpu"}), tmp_path)
    dep.plan(tmp_path / "model")
    assert [s.name for s in dep.servers] == ["encoder-0", "decode-0", "prefill-0", "prefill-1"]
    assert [s.port for s in dep.servers] == [18511, 18512, 18513, 18514]
    kv = [json.loads(s.extra_args[s.extra_args.index("--kv-transfer-config") + 1])
          for s in dep.servers[1:]]
    assert all(k["kv_connector"] == "NixlConnector" and k["kv_role"] == "kv_both" for k in kv)
    assert [k.get("kv_load_failure_policy") for k in kv] == ["recompute", None, None]
    assert [s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for s in dep.servers[1:]] == [
        "18515", "18516", "18517"]
    assert "--enable-scale-out" in dep.servers[1].extra_args  # decode only
    assert "--enable-scale-out" not in dep.servers[2].extra_args
    assert "--kv-transfer-config" not in dep.servers[0].extra_args
    assert all(s.ec_config["ec_role"] == "ec_consumer" for s in dep.servers[1:])
    g = dep.gateway_cfg
    assert g.decoders == [dep.servers[1].url] and g.prefills == [s.url for s in dep.servers[2:]]
    assert set(range(18510, 18518)) <= set(dep.cfg.fixed_ports)
    plain = Deployment(UpConfig(base_port=18510, transport="safetensors"), tmp_path / "pd")
    plain.plan(tmp_path / "model")  # E+PD: no KV connector, no prefill pool
    assert not any("--kv-transfer-config" in s.extra_args for s in plain.servers)
    assert plain.gateway_cfg.prefills == []


def test_up_cli_prefill_and_decode_flags():
    r = subprocess.run([sys.executable, "-m", "encoder_service.cli", "up", "--decode", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--decode needs --prefill" in r.stderr
    r = subprocess.run([sys.executable, "-m", "encoder_service.cli", "up", "--prefill", "1",
                        "--decode", "1", "--decoders", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "two modes" in r.stderr


def test_a_taken_port_fails_fast_with_no_server_started():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", UP + 7))  # the decode instance's port
        taken.listen()
        r = subprocess.run([sys.executable, "-m", "encoder_service.cli", "up", "--base-port",
                            str(UP + 5)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           preexec_fn=die_with_parent())
    assert r.returncode == 1
    assert f"port {UP + 7}" in r.stdout and "not free" in r.stdout
    assert "starting encoder" not in r.stdout


def test_plan_nixl_is_wired_as_mooncake_with_ucx_on_loopback(tmp_path):
    """`--transport nixl` and a tier list with it: side channels, producers and the gateway's
    availability as for mooncake; NIXL's UCX kept on loopback."""
    dep = Deployment(UpConfig(encoders=1, decoders=1, base_port=18630, transport="nixl",
                              mooncake_base_port=16670), tmp_path)
    dep.plan(tmp_path / "model")
    extra = [s.ec_config["ec_connector_extra_config"] for s in dep.servers]
    assert [e["transport"] for e in extra] == ["nixl"] * 2
    assert extra[0]["base_port"] == 16670 and extra[1]["producers"] == ["127.0.0.1:16670"]
    assert all(s.env["UCX_NET_DEVICES"] == "lo" for s in dep.servers)
    assert dep.gateway_cfg.availability.kind == "mooncake"
    assert EPDConfig.from_dict({"transport": ["shm", "nixl", "safetensors"]}).tiers == \
        ["shm", "nixl", "safetensors"]
    with pytest.raises(ValueError, match="same ports"):
        EPDConfig.from_dict({"transport": ["mooncake", "nixl"]})


def test_plan_mooncake_wires_a_side_channel_per_encoder_and_all_to_every_decoder(tmp_path):
    dep = Deployment(UpConfig(encoders=2, decoders=2, base_port=18630, transport="mooncake",
                              mooncake_base_port=16670, cpu_cores=[0, 1, 0, 1],
                              connector_extra={"memory_pool_bytes": 64 << 20,
                                               "base_port": 1234, "host": "10.0.0.1"}),
                     tmp_path)
    dep.plan(tmp_path / "model")
    extra = [s.ec_config["ec_connector_extra_config"] for s in dep.servers]
    assert [e["transport"] for e in extra] == ["mooncake"] * 4
    assert [e["host"] for e in extra] == ["127.0.0.1"] * 4  # wiring wins over connector_extra
    assert [e["memory_pool_bytes"] for e in extra] == [64 << 20] * 4  # the rest is the user's
    assert [e["base_port"] for e in extra[:2]] == [16670, 16680]
    producers = ["127.0.0.1:16670", "127.0.0.1:16680"]
    assert [e["producers"] for e in extra[2:]] == [producers, producers]
    assert all(s.env == NO_SECRET_ENV for s in dep.servers)
    g = dep.gateway_cfg
    assert g.availability.kind == "mooncake" and g.availability.producers == producers
    assert g.encoder_backend == "vllm"
    # safetensors sets no mooncake env or keys
    dep = Deployment(UpConfig(base_port=18630, transport="safetensors"), tmp_path)
    dep.plan(tmp_path / "model")
    assert all(s.env == {"VLLM_API_KEY": ""} for s in dep.servers)  # no secret: no key
    assert dep.servers[1].ec_config["ec_connector_extra_config"]["transport"] == "safetensors"
    with pytest.raises(UpError, match="memory_pool_bytez"):
        Deployment(UpConfig(transport="mooncake", connector_extra={"memory_pool_bytez": 1}),
                   tmp_path).plan(tmp_path / "model")


def test_plan_pool_backend_starts_epd_encoder_processes(tmp_path):
    from encoder_service.local.processes import PoolServer

    dep = Deployment(UpConfig(encoders=1, decoders=1, base_port=18630, transport="mooncake",
                              mooncake_base_port=16670, encoder_backend="pool",
                              pool={"max_batch_size": 4}), tmp_path)
    dep.plan(tmp_path / "model")
    (enc,) = dep.encoders
    assert isinstance(enc, PoolServer) and enc.port == 18631
    assert enc.pool_config["max_batch_size"] == 4
    assert enc.pool_config["transport"]["base_port"] == 16670
    assert enc.env == NO_SECRET_ENV
    cmd = enc.command()
    assert cmd[cmd.index("-m") + 1] == "encoder_service.encoder_pool.server"
    assert dep.gateway_cfg.encoder_backend == "pool"
    from encoder_service.encoder_pool.config import PoolConfig

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    pc = PoolConfig.from_dict(json.loads(enc.write_config().read_text()))  # what it is given
    assert pc.transport_config().transport == "mooncake" and pc.namespace == "tiny-llava"


def test_media_io_kwargs_reach_every_server_and_pool_alike(tmp_path):
    """The frames a video keeps decide its embedding: one setting for encoders and decode
    instances, vLLM servers and pools alike."""
    media = {"video": {"num_frames": 120}}
    for backend in ("vllm", "pool"):
        dep = Deployment(UpConfig(base_port=18630, encoder_backend=backend,
                                  media_io_kwargs=media, transport="safetensors"), tmp_path)
        dep.plan(tmp_path / "model")
        (enc,), (dec,) = dep.encoders, dep.decoders
        for server in (dec, enc) if backend == "vllm" else (dec,):
            args = server.extra_args
            assert json.loads(args[args.index("--media-io-kwargs") + 1]) == media
        if backend == "pool":
            assert enc.pool_config["media_io_kwargs"] == media
    dep = Deployment(UpConfig(base_port=18630, transport="safetensors"), tmp_path)
    dep.plan(tmp_path / "model")
    assert "--media-io-kwargs" not in dep.decoders[0].extra_args


def test_otlp_traces_endpoint_turns_tracing_on_in_the_gateway_and_every_vllm_server(
        tmp_path):
    url = "http://127.0.0.1:4318/v1/traces"
    dep = Deployment(UpConfig(base_port=18630, decoders=1, prefills=1, transport="safetensors",
                              otlp_traces_endpoint=url,
                              gateway={"tracing": {"sample_ratio": 0.5}}), tmp_path)
    dep.plan(tmp_path / "model")
    for s in dep.servers:
        assert s.extra_args[s.extra_args.index("--otlp-traces-endpoint") + 1] == url
        assert s.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert [s.env["OTEL_SERVICE_NAME"] for s in dep.servers] == [
        "epd-encoder-0", "epd-decode-0", "epd-prefill-0"]
    t = dep.gateway_cfg.tracing
    assert t.otlp_traces_endpoint == url and t.sample_ratio == 0.5
    off = Deployment(UpConfig(base_port=18630, transport="safetensors"), tmp_path / "off")
    off.plan(tmp_path / "model")
    assert off.gateway_cfg.tracing.otlp_traces_endpoint is None
    assert not any("--otlp-traces-endpoint" in s.extra_args or "OTEL_SERVICE_NAME" in s.env
                   for s in off.servers)
    with pytest.raises(ValueError, match="OTLP"):
        UpConfig(otlp_traces_endpoint="collector:4318")


def test_a_taken_mooncake_port_fails_fast(tmp_path):
    dep = Deployment(UpConfig(base_port=UP, transport="mooncake", mooncake_base_port=MC),
                     tmp_path)
    dep.plan(tmp_path / "model")
    # encoder 0's announcement and data connection ports
    for port in (ports.announce_port(MC), ports.stream_port(MC)):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", port))
            with pytest.raises(UpError, match=f"{port}.*mooncake_base_port"):
                dep.check_ports()


def test_plan_mooncake_store_starts_a_master_and_wires_every_server_to_it(tmp_path):
    from ec_connectors.config import EPDConfig

    dep = Deployment(UpConfig(encoders=2, decoders=2, base_port=18630,
                              transport="mooncake_store", master_port=STORE_MASTER,
                              cpu_cores=[0, 1, 0, 1],
                              connector_extra={"store_buffer_bytes": 64 << 20,
                                               "store_master": "10.0.0.1:1",
                                               "host": "10.0.0.2"}), tmp_path)
    dep.plan(tmp_path / "model")
    m = dep.master
    assert m is not None and (m.port, m.http_port, m.metrics_port) == (19960, 19961, 19962)
    assert m.address == "127.0.0.1:19960" and m.log_path.parent == tmp_path / "up" / "logs"
    assert m.env == {"MC_TCP_BIND_ADDRESS": "127.0.0.1", **ENGINE_ENV}
    extra = [s.ec_config["ec_connector_extra_config"] for s in dep.servers]
    assert [e["transport"] for e in extra] == ["mooncake_store"] * 4
    # wiring wins over connector_extra; sizes are the user's
    assert {(e["store_master"], e["store_metadata"], e["host"]) for e in extra} == {
        (m.address, m.metadata_url, "127.0.0.1")}
    assert m.metadata_url == "http://127.0.0.1:19961/metadata"
    assert [e["store_segment_bytes"] for e in extra] == [256 << 20] * 2 + [0] * 2
    assert [e["store_buffer_bytes"] for e in extra] == [64 << 20] * 4
    assert not any("base_port" in e or "producers" in e for e in extra)  # no TE tier
    for e in extra:
        c = EPDConfig.from_dict(e)
        assert c.tiers == ["mooncake_store"] and c.store_metadata_url == m.metadata_url
    assert all(s.env == NO_SECRET_ENV for s in dep.servers)
    assert dep.gateway_cfg.availability.kind == "none"  # the store has no catalog to follow
    with pytest.raises(UpError, match="store_segment_bytez"):
        Deployment(UpConfig(transport="mooncake_store",
                            connector_extra={"store_segment_bytez": 1}),
                   tmp_path).plan(tmp_path / "model")
    # transports without the store start no master
    for transport in ("safetensors", "mooncake"):
        dep = Deployment(UpConfig(base_port=18630, transport=transport), tmp_path)
        dep.plan(tmp_path / "model")
        assert dep.master is None
        assert not any("store_master" in s.ec_config["ec_connector_extra_config"]
                       for s in dep.servers)


def test_plan_tiered_wires_transfer_engine_store_and_directory(tmp_path):
    from ec_connectors.config import EPDConfig

    dep = Deployment(UpConfig(encoders=2, decoders=1, base_port=18630, transport="tiered",
                              mooncake_base_port=16670, master_port=STORE_MASTER,
                              storage_path=str(tmp_path / "ec"), cpu_cores=[0, 1, 0],
                              connector_extra={"memory_pool_bytes": 64 << 20}), tmp_path)
    dep.plan(tmp_path / "model")
    tiers = ["mooncake", "mooncake_store", "safetensors"]
    extra = [s.ec_config["ec_connector_extra_config"] for s in dep.servers]
    assert [e["transport"] for e in extra] == [tiers] * 3
    assert [e["base_port"] for e in extra[:2]] == [16670, 16680]
    assert extra[2]["producers"] == ["127.0.0.1:16670", "127.0.0.1:16680"]
    assert [e["store_segment_bytes"] for e in extra] == [256 << 20, 256 << 20, 0]
    assert [e["memory_pool_bytes"] for e in extra] == [64 << 20] * 3
    assert {e["storage_path"] for e in extra} == {str(tmp_path / "ec")}
    assert {e["store_master"] for e in extra} == {"127.0.0.1:19960"}
    for e in extra:
        assert EPDConfig.from_dict(e).tiers == tiers
    assert dep.master is not None and dep.master.port == STORE_MASTER
    g = dep.gateway_cfg  # the TE producers' announcements: the most the gateway can know
    assert g.availability.kind == "mooncake"
    assert g.availability.producers == ["127.0.0.1:16670", "127.0.0.1:16680"]


def test_plan_pool_backend_with_store_tiers_validates(tmp_path):
    from encoder_service.encoder_pool.config import PoolConfig

    dep = Deployment(UpConfig(base_port=18630, transport="tiered", mooncake_base_port=16670,
                              master_port=STORE_MASTER, encoder_backend="pool"), tmp_path)
    dep.plan(tmp_path / "model")
    (enc,) = dep.encoders
    assert enc.pool_config["transport"]["store_master"] == "127.0.0.1:19960"
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"dtype": "bfloat16"}')
    pc = PoolConfig.from_dict(json.loads(enc.write_config().read_text()))
    tc = pc.transport_config()
    assert tc.tiers == ["mooncake", "mooncake_store", "safetensors"]
    assert (tc.base_port, tc.store_segment_bytes) == (16670, 256 << 20)
    # the store key's dtype label: the model's, like a vLLM consumer of that model
    assert tc.embedding_dtype == "bfloat16" and tc.namespace == "tiny-llava"


def test_a_taken_master_port_fails_fast(tmp_path):
    dep = Deployment(UpConfig(base_port=UP, transport="mooncake_store",
                              master_port=STORE_MASTER), tmp_path)
    dep.plan(tmp_path / "model")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", STORE_MASTER + 1))  # the master's metadata port
        taken.listen()
        with pytest.raises(UpError, match="19961.*master_port"):
            dep.check_ports()
    dep = Deployment(UpConfig(base_port=18630, transport="mooncake_store",
                              master_port=18630), tmp_path)
    dep.plan(tmp_path / "model")
    with pytest.raises(UpError, match="18630 is both a base_port port and a master_port"):
        dep.check_ports()
    with socket.socket() as taken:  # the command line: exit 1, nothing started
        taken.bind(("127.0.0.1", STORE_MASTER + 2))
        taken.listen()
        r = subprocess.run([sys.executable, "-m", "encoder_service.cli", "up", "--base-port",
                            str(UP + 10), "--transport", "mooncake_store", "--master-port",
                            str(STORE_MASTER)], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, preexec_fn=die_with_parent())
    assert r.returncode == 1, r.stdout + r.stderr
    assert "port 19962" in r.stdout and "master_port" in r.stdout
    assert "starting mooncake-master" not in r.stdout and "starting encoder" not in r.stdout


def test_epd_master_and_the_new_transports_are_on_the_command_line():
    r = subprocess.run([sys.executable, "-m", "encoder_service.cli", "master", "--help"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--http-port" in r.stdout and "--metrics-port" in r.stdout
    r = subprocess.run([sys.executable, "-m", "encoder_service.cli", "up", "--help"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "mooncake_store" in r.stdout and "tiered" in r.stdout
    assert "--master-port" in r.stdout


def test_with_a_secret_every_server_requires_the_derived_key_from_its_environment(
        tmp_path, monkeypatch):
    from ec_connectors.protocol.api_keys import api_key
    from ec_connectors.protocol.secret_file import read_secret

    monkeypatch.delenv("EPD_SECRET_FILE", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "inherited-by-accident")
    secret = tmp_path / "secret"
    secret.write_bytes(b"up-deployment-secret-0123456789a")
    secret.chmod(0o600)
    key = api_key(read_secret(secret))
    for backend in ("vllm", "pool"):
        dep = Deployment(UpConfig(encoders=1, decoders=1, base_port=18630, transport="tiered",
                                  mooncake_base_port=16670, encoder_backend=backend,
                                  secret_file=str(secret)), tmp_path)
        dep.plan(tmp_path / "model")
        for s in dep.servers:
            assert s.env["VLLM_API_KEY"] == key and s.env["EPD_SECRET_FILE"] == str(secret)
            assert not [a for a in s.command() if key in a or "api-key" in a]  # never argv
        assert "VLLM_API_KEY" not in dep.master.env  # the store master takes no key
        assert dep.gateway_cfg.secret_file == str(secret)  # it presents the same key
        servers, clients, listeners = dep.trust_lines()
        assert f"deployment secret {secret}" in servers and key not in servers
        assert "no client API key" in clients
        assert "bind every interface" in listeners and "docs/trust.md" in listeners
        # the Store clients' engines only (the TE over TCP starts none), in the plan's range
        assert "(Store clients: two per process" in listeners and "25000-25999" in listeners
    dep = Deployment(UpConfig(base_port=18630, transport="mooncake", secret_file=str(secret)),
                     tmp_path)
    dep.plan(tmp_path / "model")
    assert len(dep.trust_lines()) == 2  # no engine listener to mention
    # without a secret: no key (an inherited one is cleared, the gateway could not present
    # it), loopback only, and said so
    dep = Deployment(UpConfig(base_port=18630, gateway={"api_keys": ["c1", "c2"]}), tmp_path)
    dep.plan(tmp_path / "model")
    assert all(s.env["VLLM_API_KEY"] == "" for s in dep.servers)
    assert all("--host" in (cmd := s.command()) and cmd[cmd.index("--host") + 1] == "127.0.0.1"
               for s in dep.servers)
    servers, clients = dep.trust_lines()  # safetensors: no Mooncake listener to mention
    assert "127.0.0.1 only" in servers and "take no API key" in servers
    assert "(2 key(s))" in clients and "c1" not in clients
    open_secret = tmp_path / "open"
    open_secret.write_bytes(b"x" * 32)
    open_secret.chmod(0o644)
    with pytest.raises(UpError, match="chmod 600"):
        load_up_config(None, {"secret_file": str(open_secret)})


def test_auto_wires_shared_memory_one_directory_per_deployment(tmp_path):
    from ec_connectors.config import EPDConfig

    dep = Deployment(UpConfig(encoders=2, decoders=1, base_port=18630,
                              connector_extra={"shm_consumer_pool_bytes": 64 << 20}), tmp_path)
    dep.plan(tmp_path / "model")
    assert dep.cfg.transport_choice[0] == "shm"
    extra = [s.ec_config["ec_connector_extra_config"] for s in dep.servers]
    assert [e["transport"] for e in extra] == ["shm"] * 3
    assert {e["shm_path"] for e in extra} == {dep.cfg.shm_path}  # one directory per deployment
    assert [e.get("shm_arena_bytes") for e in extra] == [up_config.SHM_ARENA_BYTES] * 2 + [None]
    assert extra[2]["shm_consumer_pool_bytes"] == 64 << 20  # sizes are the user's
    assert all(EPDConfig.from_dict(e).tiers == ["shm"] for e in extra)
    # the gateway (on this host) follows the shm records of the deployment's directory
    assert dep.gateway_cfg.availability.kind == "shm"
    assert dep.gateway_cfg.availability.shm_path == dep.cfg.shm_path


def test_plan_elastic_roles_fixes_every_instance_up_to_the_maximum(tmp_path):
    """`--encoders 1:2 --decode 1:2` under E/P/D: every instance up to the maximum has its
    port, core and side channel from the start; the minimum starts and the gateway knows
    only those; the rest wait in `spare` (scaler.py), each with its final command line."""
    cfg = UpConfig(encoders=1, decoders=1, prefills=1, base_port=18510, transport="safetensors",
                   scaling={"encoders_max": 2, "decoders_max": 2})
    dep = Deployment(cfg, tmp_path)
    dep.plan(tmp_path / "model")
    assert [(s.name, s.port) for s in dep.servers] == [
        ("encoder-0", 18511), ("decode-0", 18513), ("prefill-0", 18515)]
    assert [(s.name, s.port) for s in dep.spare] == [("encoder-1", 18512), ("decode-1", 18514)]
    kv = {s.name: s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for s in [*dep.servers, *dep.spare]
          if "VLLM_NIXL_SIDE_CHANNEL_PORT" in s.env}
    assert kv == {"decode-0": "18516", "decode-1": "18517", "prefill-0": "18518"}
    decode1 = dep.spare[1]
    assert "--enable-scale-out" in decode1.extra_args
    assert json.loads(decode1.extra_args[decode1.extra_args.index("--kv-transfer-config") + 1])[
        "kv_load_failure_policy"] == "recompute"
    g = dep.gateway_cfg
    assert (g.encoders, g.decoders, g.prefills) == (
        ["http://127.0.0.1:18511"], ["http://127.0.0.1:18513"], ["http://127.0.0.1:18515"])
    assert set(range(18510, 18519)) <= set(cfg.fixed_ports)
    with pytest.raises(UpError, match="elastic roles count at their maximum"):
        Deployment(cfg.model_copy(update={"cpu_cores": [0, 1, 0]}), tmp_path / "c").plan(
            tmp_path / "model")


def test_up_cli_min_max_flags():
    r = subprocess.run([sys.executable, "-m", "encoder_service.cli", "up", "--encoders", "3:2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "encoders MIN:MAX is 3:2" in r.stderr
    r = subprocess.run([sys.executable, "-m", "encoder_service.cli", "up", "--decoders", "1-2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "give N or MIN:MAX" in r.stderr


def test_a_second_stop_signal_waits_for_the_first_shutdown(capsys):
    """`epd up`'s first SIGTERM or Ctrl-C starts the shutdown; one more while it runs (a
    session stop, a second Ctrl-C) only says to wait: it must not abort the shutdown."""
    import os
    import signal

    from encoder_service.local import up

    old = {s: signal.signal(s, up._raise_shutdown) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(up._Shutdown, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)  # let the handler run here, not later
        os.kill(os.getpid(), signal.SIGTERM)  # mid-shutdown: no second _Shutdown
        os.kill(os.getpid(), signal.SIGINT)
        signal.sigtimedwait([], 0)
        assert capsys.readouterr().out.count("already stopping") == 2
    finally:
        for s, h in old.items():
            signal.signal(s, h)
