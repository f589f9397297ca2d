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
    return container["command"] + container.get("args", [])


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
    assert roles == {"encoder", "pd", "mooncake-master"}
    assert data["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app": "epd"}}}]}]
    clients = policies["epd-gateway-clients"]["spec"]
    assert clients["ingress"] == [{"ports": [{"port": 8000, "protocol": "TCP"}]}]
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        (container,) = d["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container.get("env", [])}
        role = d["metadata"]["labels"]["role"]
        if role == "gateway":
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
    assert published == {"gateway": ["${EPD_GATEWAY_PUBLISH:-8000}:8000"]}
    for name in ("encoder", "prefill-decode", "gateway"):
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
    assert {n for n, _, _ in servers} == {"compose/encoder", "compose/prefill-decode",
                                          "k8s/epd-encoder", "k8s/epd-prefill-decode"}
    for name, argv, env in servers:
        # `epd vllm` derives $VLLM_API_KEY from $EPD_SECRET_FILE before vLLM starts
        assert argv[:3] == ["epd", "vllm", "serve"], name
        assert not [a for a in argv if a.startswith("--api-key")], name
        assert "VLLM_API_KEY" not in env, name  # a key written into a manifest is a leak
        assert env["EPD_SECRET_FILE"] in ("/run/secrets/epd_secret", "/var/run/epd/secret")


def test_epd_vllm_puts_the_key_derived_from_the_secret_in_the_environment(monkeypatch,
                                                                          tmp_path):
    """What those commands run: `epd vllm` exports the key before vLLM is imported."""
    from ec_connectors.protocol.secret import api_key, read_secret
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
    for name, s in doc["services"].items():
        expected = ["data-plane", "clients"] if name == "gateway" else ["data-plane"]
        assert s["networks"] == expected, name


def test_every_vllm_server_loads_the_server_guard():
    """Bounds on metadata-only items, the key on every route, reasons on refusals
    (ec_connectors/guard/server_guard.py): the same --middleware `epd up` gives its servers."""
    from encoder_service.local.processes import SERVER_GUARD

    module, _, name = SERVER_GUARD.rpartition(".")
    assert callable(getattr(__import__(module, fromlist=[name]), name))
    servers = vllm_servers()
    assert len(servers) == 4
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
    for name in ("encoder", "prefill-decode"):
        s = compose["services"][name]
        argv = shlex.split(s["command"])
        assert argv[argv.index("--port") + 1] == "9123" and argv[3] == model
        assert "9123" in s["healthcheck"]["test"][-1]
        assert f"{model}/epd_build.json" in s["entrypoint"]
    assert compose["services"]["model-init"]["command"][-1] == model
    for d in k8s:
        if d["kind"] == "Deployment" and d["metadata"]["labels"]["role"] in ("encoder", "pd"):
            pod = d["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            argv = server_argv(k8s_argv(c))
            assert argv[3] == model and argv[argv.index("--port") + 1] == "9123"
            assert c["readinessProbe"]["httpGet"]["port"] == 9123
            assert {"name": "EPD_SECRET_FILE", "value": "/etc/epd-test/secret"} in c["env"]
            assert pod["initContainers"][0]["command"][-1] == model
        if d["kind"] == "Service" and d["metadata"]["name"] in ("epd-encoder",
                                                               "epd-prefill-decode"):
            assert d["spec"]["ports"] == [{"port": 9123}]


def test_a_template_naming_an_unknown_setting_is_an_error():
    render = _render_module()
    with pytest.raises(KeyError, match="no_such_setting"):
        render.render_text("port: {{no_such_setting}}", {"vllm_port": "8000"})


def test_compose_services_stop_at_once_and_the_servers_restart():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert all(s.get("init") is True for s in services.values())
    for name in ("mooncake-master", "encoder", "prefill-decode", "gateway"):
        assert services[name]["restart"] == "unless-stopped", name
    assert "restart" not in services["model-init"]  # runs once


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
