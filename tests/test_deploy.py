"""The deployment files users apply as they are: every Kubernetes manifest validates against
the Kubernetes API schemas (kubernetes-validate, strict: no unknown fields), the compose file
against the compose specification (the JSON schema check-jsonschema vendors), and both keep
the trust boundary: clients reach the gateway only, the data plane binds the pod's address,
EPD processes read the deployment secret."""

from __future__ import annotations

import json
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
