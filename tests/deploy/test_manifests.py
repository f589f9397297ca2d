"""The deployment files users apply as they are: every Kubernetes manifest validates against
the Kubernetes API schemas (kubernetes-validate, strict: no unknown fields), the compose file
against the compose specification (the JSON schema check-jsonschema vendors), and both keep
the trust boundary: clients reach the gateway only, the data plane binds the pod's address,
EPD processes read the deployment secret. Both files are rendered from deploy/settings.toml
(deploy/render.py): the checked-in ones must be current. The fast lane's, unlike the rest of
tests/deploy: what the compose stack does when it runs is the deploy lane's
(test_compose_stack.py, `./run.sh test-deploy`)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time

import kubernetes_validate
import pytest
import yaml

from tests.helpers import ROOT

K8S = ROOT / "deploy" / "k8s" / "epd.yaml"
COMPOSE = ROOT / "docker-compose.yml"
K8S_VERSION = "1.30.0"
WAIT_FOR = ROOT / "deploy" / "wait_for.py"


def _render_module():
    spec = importlib.util.spec_from_file_location("epd_deploy_render", ROOT / "deploy" /
                                                  "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def server_argv(argv: list[str]) -> list[str]:
    """The server's own command: what follows `wait_for.py ... --`, else all of it."""
    return argv[argv.index("--") + 1:] if "wait_for.py" in " ".join(argv) else argv


def k8s_argv(container: dict) -> list[str]:
    return container.get("command", []) + container.get("args", [])


def manifests() -> list[dict]:
    return [d for d in yaml.safe_load_all(K8S.read_text()) if d]


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_validates_against_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_broken_manifest_is_caught():
    bad = json.loads(json.dumps(manifests()[1]))
    bad["spec"]["template"]["spec"]["containers"][0]["port"] = 8000  # not a field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_k8s_keeps_the_data_plane_inside():
    docs = manifests()
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    data = policies["epd-data-plane"]["spec"]
    roles = {v for e in data["podSelector"]["matchExpressions"] if e["key"] == "role"
             for v in e["values"]}
    assert roles == {"encoder", "pd", "prefill", "decode", "mooncake-master"}
    assert data["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app": "epd"}}}]}]
    clients = policies["epd-gateway-clients"]["spec"]
    assert clients["podSelector"]["matchExpressions"] == [
        {"key": "app", "operator": "In", "values": ["epd"]},
        {"key": "role", "operator": "In", "values": ["gateway", "gateway-kv"]}]
    assert clients["ingress"] == [{"ports": [{"port": 8000, "protocol": "TCP"}]}]
    # every pod is under exactly one of the two policies
    deployed = {d["metadata"]["labels"]["role"] for d in docs if d["kind"] == "Deployment"}
    assert deployed == roles | {"gateway", "gateway-kv"}
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        (container,) = d["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container.get("env", [])}
        role = d["metadata"]["labels"]["role"]
        if role in ("gateway", "gateway-kv"):
            continue
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert "0.0.0.0" not in k8s_argv(container)  # binds the pod's own address
        if role != "mooncake-master":
            assert env["MC_TCP_BIND_ADDRESS"]["value"] == "$(POD_IP)"
            assert env["EPD_SECRET_FILE"]["value"] == "/var/run/epd/secret"


def test_compose_validates_and_publishes_only_the_gateway():
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                          "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert published == {"gateway": ["${EPD_GATEWAY_PUBLISH:-8000}:8000"],
                         "gateway-kv": ["${EPD_KV_GATEWAY_PUBLISH:-8001}:8000"],
                         # opt-in (profile monitoring), on the host's loopback by default
                         "prometheus": ["${EPD_PROMETHEUS_PUBLISH:-127.0.0.1:9090}:9090"]}
    for name in ("encoder", "prefill-decode", "gateway", "prefill", "decode", "gateway-kv"):
        assert services[name]["environment"]["EPD_SECRET_FILE"] == "/run/secrets/epd_secret"


def test_check_jsonschema_catches_a_broken_compose_file(tmp_path):
    bad = tmp_path / "compose.yml"
    bad.write_text(COMPOSE.read_text().replace("  gateway:", "  gateway:\n    portz: [1]"))
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                          "vendor.compose-spec", str(bad)], capture_output=True, text=True)
    assert run.returncode != 0


# -- keys: every vLLM server requires the deployment's key, from the secret, never in argv ---
def vllm_servers() -> list[tuple[str, list[str], dict]]:
    """(name, argv, environment) of every vLLM server in compose and k8s."""
    out = []
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, s in services.items():
        argv = shlex.split(s["command"]) if isinstance(s.get("command"), str) else \
            s.get("command") or []
        if "serve" in argv[:3]:
            out.append((f"compose/{name}", argv, dict(s.get("environment", {}))))
    for d in manifests():
        if d["kind"] == "Deployment":
            (c,) = d["spec"]["template"]["spec"]["containers"]
            argv = server_argv(k8s_argv(c))
            if "serve" in argv[:3]:
                env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}
                out.append((f"k8s/{d['metadata']['name']}", argv, env))
    return out


def test_every_vllm_server_takes_its_key_from_the_secret_never_from_argv():
    servers = vllm_servers()
    assert {n for n, _, _ in servers} == {
        "compose/encoder", "compose/prefill-decode", "compose/prefill", "compose/decode",
        "k8s/epd-encoder", "k8s/epd-prefill-decode", "k8s/epd-prefill", "k8s/epd-decode"}
    for name, argv, env in servers:
        # `epd vllm` derives $VLLM_API_KEY from $EPD_SECRET_FILE before vLLM starts
        assert argv[:3] == ["epd", "vllm", "serve"], name
        assert not [a for a in argv if a.startswith("--api-key")], name
        assert "VLLM_API_KEY" not in env, name  # a key written into a manifest is a leak
        assert env["EPD_SECRET_FILE"] in ("/run/secrets/epd_secret", "/var/run/epd/secret")


def test_epd_vllm_puts_the_key_derived_from_the_secret_in_the_environment(monkeypatch,
                                                                          tmp_path):
    """What those commands run: `epd vllm` exports the key before vLLM is imported."""
    from ec_connectors.protocol.api_keys import api_key
    from ec_connectors.protocol.secret_file import read_secret
    from encoder_service import cli
    from encoder_service.local import vllm_cli

    secret = tmp_path / "secret"
    secret.write_bytes(b"compose-deployment-secret-012345")
    secret.chmod(0o600)
    monkeypatch.setenv("EPD_SECRET_FILE", str(secret))
    # unset for export_api_key (empty counts as unset), and registered with monkeypatch so
    # the key it writes into this process's environment is removed again: left behind, it
    # keyed every server later tests of this worker start in-process (the encoder pool's)
    monkeypatch.setenv("VLLM_API_KEY", "")
    monkeypatch.delenv("EPD_PARENT_PID", raising=False)

    class Reached(Exception):
        pass

    def stop() -> None:  # the next step would import and run vLLM
        raise Reached(os.environ.get("VLLM_API_KEY"))

    monkeypatch.setattr(vllm_cli, "_patch_version_lookup", stop)
    with pytest.raises(Reached) as got:
        cli.main(["vllm", "serve", "/models/x"])
    assert got.value.args[0] == api_key(read_secret(secret))


def test_the_gateways_hold_the_secret_and_take_a_client_key_from_outside_the_files():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    env = services["gateway"]["environment"]
    assert env["EPD_SECRET_FILE"] == "/run/secrets/epd_secret"
    assert services["gateway"]["secrets"] == ["epd_secret"]
    assert env["EPD_GATEWAY_API_KEY"] == "${EPD_GATEWAY_API_KEY:-}"  # from the shell, or none
    (gw,) = [d for d in manifests() if d["kind"] == "Deployment"
             and d["metadata"]["labels"]["role"] == "gateway"]
    pod = gw["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    k8s_env = {e["name"]: e for e in c["env"]}
    assert k8s_env["EPD_SECRET_FILE"]["value"] == "/var/run/epd/secret"
    assert {"name": "epd-secret", "mountPath": "/var/run/epd", "readOnly": True} in \
        c["volumeMounts"]
    assert {"name": "epd-secret", "secret": {"secretName": "epd-secret", "defaultMode": 0o400}} \
        in pod["volumes"]
    ref = k8s_env["EPD_GATEWAY_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "epd-client-key", "key": "key", "optional": True}


def test_compose_keeps_the_data_plane_on_an_internal_network():
    """The Mooncake Transfer Engine's listeners bind every interface of their container
    (docs/trust.md): only EPD containers share that network, and it has no way out."""
    doc = yaml.safe_load(COMPOSE.read_text())
    assert doc["networks"]["data-plane"] == {"internal": True}
    assert doc["networks"]["monitoring"] == {}  # Prometheus' published port only
    for name, s in doc["services"].items():
        expected = ["data-plane", "clients"] if name.startswith("gateway") else \
            ["data-plane", "monitoring"] if name == "prometheus" else ["data-plane"]
        assert s["networks"] == expected, name


def test_every_vllm_server_loads_the_server_guard():
    """Bounds on metadata-only items, the key on every route, reasons on refusals
    (ec_connectors/guard/server_guard.py): the same --middleware `epd up` gives its servers."""
    from encoder_service.local.processes import SERVER_GUARD

    module, _, name = SERVER_GUARD.rpartition(".")
    assert callable(getattr(__import__(module, fromlist=[name]), name))
    servers = vllm_servers()
    assert len(servers) == 8
    for server, argv, _ in servers:
        assert argv[argv.index("--middleware") + 1] == SERVER_GUARD, server


# -- one source: deploy/settings.toml -> docker-compose.yml, deploy/k8s/epd.yaml -------------
def test_the_checked_in_files_are_rendered_from_the_settings():
    run = subprocess.run([sys.executable, str(ROOT / "deploy" / "render.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_setting_reaches_both_files_everywhere_it_is_used():
    render = _render_module()
    settings = render.load_settings()
    settings["ports"]["vllm"] = 9123
    settings["model"]["models_dir"] = "/srv/models"
    settings["secret"]["k8s"] = "/etc/epd-test/secret"
    out = {p.name: t for p, t in render.render(settings).items()}
    compose = yaml.safe_load(out["docker-compose.yml"])
    k8s = [d for d in yaml.safe_load_all(out["epd.yaml"]) if d]
    model = "/srv/models/tiny-qwen-omni"
    gw = compose["services"]["gateway"]["command"]
    assert "http://encoder:9123" in gw and "http://prefill-decode:9123" in gw
    gw_kv = compose["services"]["gateway-kv"]["command"]
    assert {"http://encoder:9123", "http://decode:9123", "http://prefill:9123"} <= set(gw_kv)
    for name in ("encoder", "prefill-decode", "prefill", "decode"):
        s = compose["services"][name]
        argv = shlex.split(s["command"])
        assert argv[argv.index("--port") + 1] == "9123" and argv[3] == model
        assert "9123" in s["healthcheck"]["test"][-1]
        assert f"{model}/epd_build.json" in s["entrypoint"]
    assert compose["services"]["model-init"]["command"][-1] == model
    for d in k8s:
        if d["kind"] == "Deployment" and d["metadata"]["labels"]["role"] in (
                "encoder", "pd", "prefill", "decode"):
            pod = d["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            argv = server_argv(k8s_argv(c))
            assert argv[3] == model and argv[argv.index("--port") + 1] == "9123"
            assert c["readinessProbe"]["httpGet"]["port"] == 9123
            assert {"name": "EPD_SECRET_FILE", "value": "/etc/epd-test/secret"} in c["env"]
            assert pod["initContainers"][0]["command"][-1] == model
        if d["kind"] == "Service" and d["metadata"]["name"] in (
                "epd-encoder", "epd-prefill-decode", "epd-prefill", "epd-decode"):
            assert d["spec"]["ports"] == [{"port": 9123}]
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "epd-gateway-kv":
            (c,) = d["spec"]["template"]["spec"]["containers"]
            assert {"http://epd-decode:9123", "http://epd-prefill:9123"} <= set(c["command"])


def test_a_template_naming_an_unknown_setting_is_an_error():
    render = _render_module()
    with pytest.raises(KeyError, match="no_such_setting"):
        render.render_text("port: {{no_such_setting}}", {"vllm_port": "8000"})


def test_compose_services_stop_at_once_and_the_servers_restart():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert all(s.get("init") is True for s in services.values())
    for name in ("mooncake-master", "encoder", "prefill-decode", "gateway", "prefill",
                 "decode", "gateway-kv"):
        assert services[name]["restart"] == "unless-stopped", name
    assert "restart" not in services["model-init"]  # runs once


# -- E/P/D: compose profile epd-kv, k8s epd-prefill / epd-decode / epd-gateway-kv ------------
KV_SERVICES = {"prefill": "compose/prefill", "decode": "compose/decode"}
KV_DEPLOYMENTS = {"prefill": "k8s/epd-prefill", "decode": "k8s/epd-decode"}


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.fixture(scope="module")
def up_epd(tmp_path_factory) -> dict[str, list[str]]:
    """The argv `epd up --prefill 1` plans for its prefill and decode instances."""
    from encoder_service.local.up import Deployment
    from encoder_service.local.up_config import UpConfig

    tmp = tmp_path_factory.mktemp("up-epd")
    dep = Deployment(UpConfig(decoders=1, prefills=1, transport="safetensors"), tmp)
    dep.plan(tmp / "model")
    return {s.name.split("-")[0]: list(s.extra_args) for s in dep.servers
            if s.name.startswith(("prefill", "decode"))}


def test_the_epd_kv_roles_get_the_kv_connector_epd_up_gives_its_own(up_epd):
    servers = {name: (argv, env) for name, argv, env in vllm_servers()}
    pd_ec = {_flag(servers[n][0], "--ec-transfer-config") for n in ("compose/prefill-decode",
                                                                     "k8s/epd-prefill-decode")}
    for role in ("prefill", "decode"):
        want = json.loads(_flag(up_epd[role], "--kv-transfer-config"))
        for name in (KV_SERVICES[role], KV_DEPLOYMENTS[role]):
            argv, _ = servers[name]
            assert json.loads(_flag(argv, "--kv-transfer-config")) == want, name
            # an EC consumer like the E+PD instance; decode flags on decode instances only
            assert _flag(argv, "--ec-transfer-config") in pd_ec, name
            assert ("--enable-scale-out" in argv) == ("--enable-scale-out" in up_epd[role])
    decode = json.loads(_flag(servers["compose/decode"][0], "--kv-transfer-config"))
    prefill = json.loads(_flag(servers["compose/prefill"][0], "--kv-transfer-config"))
    assert decode["kv_load_failure_policy"] == "recompute"
    assert "kv_load_failure_policy" not in prefill
    assert prefill["kv_connector"] == "NixlConnector" and prefill["kv_buffer_device"] == "cpu"


def test_the_default_stack_has_no_kv_connector_and_the_kv_roles_are_opt_in():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    profiled = {n for n, s in services.items() if "profiles" in s}
    assert profiled == {"prefill", "decode", "gateway-kv", "prometheus"}
    assert all(services[n]["profiles"] == ["epd-kv"] for n in profiled - {"prometheus"})
    assert services["prometheus"]["profiles"] == ["monitoring"]
    for name, argv, env in vllm_servers():
        kv = name in KV_SERVICES.values() or name in KV_DEPLOYMENTS.values()
        assert ("--kv-transfer-config" in argv) == kv, name
        assert any(k.startswith("VLLM_NIXL") for k in env) == kv, name
    for d in manifests():  # k8s: only the E+PD stack runs until scaled
        if d["kind"] == "Deployment":
            role = d["metadata"]["labels"]["role"]
            kv = role in ("prefill", "decode", "gateway-kv")
            assert (d["spec"]["replicas"] == 0) == kv, role
    # nothing of the default stack waits on an opt-in service
    for name, s in services.items():
        if name not in profiled:
            assert not profiled & set(s.get("depends_on", {})), name


def test_the_epd_kv_gateways_list_the_prefill_service():
    from encoder_service.gateway.cli import config_from_argv

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    gateways = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
                for d in manifests() if d["kind"] == "Deployment"
                and d["metadata"]["labels"]["role"].startswith("gateway")}
    for argv, prefill, decode in (
            (services["gateway-kv"]["command"], "http://prefill:8000", "http://decode:8000"),
            (k8s_argv(gateways["epd-gateway-kv"]), "http://epd-prefill:8000",
             "http://epd-decode:8000")):
        cfg = config_from_argv(argv[2:])  # as `epd gateway` parses it
        assert cfg.prefills == [prefill] and cfg.decoders == [decode]
    for argv in (services["gateway"]["command"], k8s_argv(gateways["epd-gateway"])):
        assert config_from_argv(argv[2:]).prefills == []
    assert set(services["gateway-kv"]["depends_on"]) == {"encoder", "prefill", "decode"}
    selectors = {d["metadata"]["name"]: d["spec"]["selector"] for d in manifests()
                 if d["kind"] == "Service"}
    assert selectors["epd-prefill"] == {"app": "epd", "role": "prefill"}
    assert selectors["epd-decode"] == {"app": "epd", "role": "decode"}
    assert selectors["epd-gateway-kv"] == {"app": "epd", "role": "gateway-kv"}


def test_kv_side_channels_are_distinct_reachable_and_clear_of_the_fixed_ports():
    from ec_connectors.protocol import ports

    servers = {name: env for name, _, env in vllm_servers()}
    compose_env = yaml.safe_load(COMPOSE.read_text())["services"]
    engine = range(int(compose_env["encoder"]["environment"]["MC_MIN_RPC_PORT"]),
                   int(compose_env["encoder"]["environment"]["MC_MAX_RPC_PORT"]) + 1)
    fixed = {8000, *ports.master_ports(ports.MASTER_RPC_PORT), *ports.DEFAULT_FIXED}
    for names in (KV_SERVICES, KV_DEPLOYMENTS):
        side = {role: int(servers[n]["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for role, n in names.items()}
        assert len(set(side.values())) == 2, side
        for port in side.values():  # +1 per data-parallel rank: keep a margin too
            assert not {port, port + 1} & fixed and port not in engine, port
    # the peer dials what the prefill instance advertises: its service name, its pod's IP
    for role in ("prefill", "decode"):
        assert servers[KV_SERVICES[role]]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == role
        assert servers[KV_DEPLOYMENTS[role]]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
    render = _render_module()
    for prefill, decode in ((5600, 5600), (5600, ports.MASTER_RPC_PORT + 1),
                            (ports.GATEWAY_PORT, 5610), (5600, 8000)):
        settings = render.load_settings()
        settings["kv"].update(prefill_side_channel=prefill, decode_side_channel=decode)
        with pytest.raises(ValueError, match=r"\[kv\]"):
            render.render(settings)


# -- the monitoring profile: Prometheus scraping every service that serves /metrics ----------
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"


def metrics_ports(services: dict) -> dict[str, int]:
    """Every compose service that serves /metrics -> its port, from its command: vLLM
    servers and gateways on --port, the store master on its RPC --port + 2 (ports.py)."""
    from ec_connectors.protocol import ports

    out = {}
    for name, s in services.items():
        cmd = s.get("command") or []
        argv = shlex.split(cmd) if isinstance(cmd, str) else cmd
        port = _flag(argv, "--port")
        if argv[:3] == ["epd", "vllm", "serve"] or argv[:2] == ["epd", "gateway"]:
            out[name] = int(port)
        elif argv[:2] == ["epd", "master"]:
            out[name] = ports.master_metrics_port(int(port))
    return out


def scraped_ports(text: str | None = None) -> dict[str, int]:
    """deploy/prometheus/prometheus.yml (or `text`): each job (one per compose service, found
    by DNS: every replica; none while the service is not running) -> the port it scrapes."""
    scraped = {}
    config = yaml.safe_load(PROMETHEUS_YML.read_text() if text is None else text)
    for job in config["scrape_configs"]:
        assert set(job) == {"job_name", "dns_sd_configs"}, job  # nothing else
        (sd,) = job["dns_sd_configs"]
        assert sd["type"] == "A" and sd["names"] == [job["job_name"]], job
        scraped[job["job_name"]] = sd["port"]
    return scraped


def test_the_monitoring_profile_scrapes_every_service_that_serves_metrics():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    want = metrics_ports(services)
    assert set(want) == {"gateway", "encoder", "prefill-decode", "mooncake-master", "prefill",
                         "decode", "gateway-kv"}
    assert scraped_ports() == want
    prom = services["prometheus"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in \
        prom["volumes"]
    assert prom["build"]["context"] == "deploy/prometheus"
    assert "data-plane" in prom["networks"]  # where every target is
    dockerfile = (ROOT / "deploy" / "prometheus" / "Dockerfile").read_text()
    assert "--config.file=/etc/prometheus/prometheus.yml" in dockerfile


def test_a_service_missing_from_the_monitoring_profile_is_caught_and_ports_follow():
    """A service the scrape jobs miss is caught; a moved port moves in prometheus.yml too:
    deploy/render.py renders it from the same settings as the compose file."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    services["encoder-2"] = dict(services["encoder"])
    assert metrics_ports(services) != scraped_ports()
    settings = _render_module().load_settings()
    settings["ports"]["vllm"], settings["ports"]["gateway"] = 9123, 9124
    rendered = _render_module().render(settings)
    moved = yaml.safe_load(rendered[COMPOSE])["services"]
    scraped = scraped_ports(rendered[PROMETHEUS_YML])
    assert metrics_ports(moved) == scraped
    assert scraped["encoder"] == scraped["decode"] == 9123 and scraped["gateway"] == 9124


# -- wait_for.py: the servers' entry point, so podman-compose starts them in order too -------
def _wait_for(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WAIT_FOR), *args], capture_output=True,
                          text=True, timeout=timeout)


def test_wait_for_starts_the_command_once_the_file_exists(tmp_path):
    marker = tmp_path / "model" / "epd_build.json"
    proc = subprocess.Popen([sys.executable, str(WAIT_FOR), "--file", str(marker), "--",
                             sys.executable, "-c", "print('started')"],
                            stdout=subprocess.PIPE, text=True)
    time.sleep(1.5)
    assert proc.poll() is None  # still waiting
    marker.parent.mkdir()
    marker.write_text("{}")
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "started" in out


def test_wait_for_starts_anyway_past_its_deadline_and_says_what_was_missing():
    t0 = time.monotonic()
    run = _wait_for(["--tcp", "127.0.0.1:1", "--timeout", "1", "--", sys.executable, "-c",
                     "print('started')"])
    assert run.returncode == 0 and "started" in run.stdout
    assert "still missing after 1 s: tcp 127.0.0.1:1" in run.stdout
    assert time.monotonic() - t0 < 15


def test_wait_for_without_a_command_is_a_usage_error():
    assert _wait_for(["--file", "/x"]).returncode == 2
    assert _wait_for(["--file", "/x", "--"]).returncode == 2


def _member_args(command: list[str]) -> tuple[list[str], dict[str, str]]:
    argv = shlex.split(command[2])  # ["sh", "-c", "epd member ..."]
    return argv[:3], dict(zip(argv[3::2], argv[4::2], strict=True))


def test_the_elastic_roles_autoscale_on_the_gateways_load_and_drain_before_they_stop():
    """Elastic roles: an autoscaling/v2 HPA per elastic Deployment on the gateway's
    epd_gateway_load (external, through prometheus-adapter's rule below) with `epd up`'s
    targets and windows; each pod joins the gateway once healthy (postStart) and drains out of
    it through the admin API before SIGTERM (preStop), within its grace period."""
    from encoder_service.gateway import member_cli
    from encoder_service.local.scale_rules import ScalingConfig

    settings = _render_module().load_settings()
    docs = manifests()
    hpas = {d["spec"]["scaleTargetRef"]["name"]: d["spec"] for d in docs
            if d["kind"] == "HorizontalPodAutoscaler"}
    assert set(hpas) == {"epd-encoder", "epd-prefill-decode"}
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    gateway_port = settings["ports"]["gateway"]
    sc = ScalingConfig()
    for name, role, member, policy, most in (
            ("epd-encoder", "encoder", "encoder", sc.encoder, "encoders_max"),
            ("epd-prefill-decode", "decode", "decoder", sc.decode, "decoders_max")):
        hpa = hpas[name]
        (metric,) = hpa["metrics"]
        assert metric["external"]["metric"] == {"name": "epd_gateway_load",
                                                "selector": {"matchLabels": {"role": role}}}
        assert float(metric["external"]["target"]["averageValue"]) == policy.target
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (
            1, settings["autoscaling"][most])
        up, down = hpa["behavior"]["scaleUp"], hpa["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= policy.idle_window_s
        assert up["policies"] == [{"type": "Pods", "value": 1,
                                   "periodSeconds": max(1, int(policy.up_cooldown_s))}]
        pod = deployments[name]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} \
            in c["env"]
        port = c["ports"][0]["containerPort"]
        for hook, action in (("postStart", "join"), ("preStop", "leave")):
            command = c["lifecycle"][hook]["exec"]["command"]
            head, args = _member_args(command)
            assert head == ["epd", "member", action]
            assert args["--gateway"] == f"http://epd-gateway:{gateway_port}"
            assert (args["--role"], args["--url"]) == (member, f"http://$POD_IP:{port}")
            parsed = member_cli.parser().parse_args(  # `epd member` takes them
                [action, *(x for kv in args.items() for x in kv)])
            assert (parsed.action, parsed.role) == (action, member)
        _, leave = _member_args(c["lifecycle"]["preStop"]["exec"]["command"])
        assert pod["terminationGracePeriodSeconds"] > float(leave["--timeout-s"])
    (adapter,) = [d for d in docs if d["kind"] == "ConfigMap"
                  and d["metadata"]["name"] == "epd-prometheus-adapter"]
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["externalRules"]
    assert rule["name"] == {"as": "epd_gateway_load"}
    assert rule["seriesQuery"].startswith("epd_gateway_load{")
    assert "`epd_gateway_load`" in (ROOT / "docs" / "metrics.md").read_text()
