"""The deployment files users apply as they are: every Kubernetes manifest validates against
the Kubernetes API schemas (kubernetes-validate, strict: no unknown fields), the compose file
against the compose specification (the JSON schema check-jsonschema vendors), and both keep
the trust boundary: clients reach the gateway only, the data plane binds the pod's address,
EPD processes read the deployment secret."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from tests.helpers import ROOT

K8S = ROOT / "deploy" / "k8s" / "epd.yaml"
COMPOSE = ROOT / "docker-compose.yml"
K8S_VERSION = "1.30.0"


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
        assert "0.0.0.0" not in container["command"]  # binds the pod's own address
        if role != "mooncake-master":
            assert env["MC_TCP_BIND_ADDRESS"]["value"] == "$(POD_IP)"
            assert env["EPD_SECRET_FILE"]["value"] == "/var/run/epd/secret"


def test_compose_validates_and_publishes_only_the_gateway():
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                          "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert published == {"gateway": ["8000:8000"]}
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
            if "serve" in c["command"][:3]:
                env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}
                out.append((f"k8s/{d['metadata']['name']}", c["command"], env))
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
    (ec_connectors/server_guard.py): the same --middleware `epd up` gives its servers."""
    from encoder_service.local.processes import SERVER_GUARD

    module, _, name = SERVER_GUARD.rpartition(".")
    assert callable(getattr(__import__(module, fromlist=[name]), name))
    servers = vllm_servers()
    assert len(servers) == 4
    for server, argv, _ in servers:
        assert argv[argv.index("--middleware") + 1] == SERVER_GUARD, server
