"""The NIXL variant of the deployment files (docker-compose.nixl.yml, deploy/k8s/epd-nixl.yaml,
rendered by deploy/render.py from [nixl]): what a consumer needs to pull from every producer
peer to peer, checked against the connector's own code. Each producer binds and announces the
name it is given (`host`), and a consumer's guard refuses a location not among its
`producers`: so every encoder must be named, under the name each consumer lists, on ports
each file declares, with UCX on the container's interface and the deployment secret mounted.
The fast lane's (conftest.py FAST); the deploy lane runs the compose file
(test_compose_nixl.py)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from ec_connectors.config import EPDConfig
from ec_connectors.protocol.ports import PURPOSE_SERVE, announce_port, port_for
from scheduler_hooks.decisions import pull_location
from tests.deploy.test_manifests import K8S_VERSION, _render_module, k8s_argv, server_argv
from tests.helpers import ROOT

K8S = ROOT / "deploy" / "k8s" / "epd-nixl.yaml"
COMPOSE = ROOT / "docker-compose.nixl.yml"
VLLM = ("encoder", "prefill-decode", "prefill", "decode")  # compose services: vLLM servers


def docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(K8S.read_text()) if d]


def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def ec_conf(argv: list[str]) -> EPDConfig:
    """A server's --ec-transfer-config, parsed as the connector parses it."""
    raw = json.loads(argv[argv.index("--ec-transfer-config") + 1])
    assert raw["ec_connector"] == "EPDConnector"
    return EPDConfig.from_dict(raw["ec_connector_extra_config"])


def side_channel(conf: EPDConfig) -> int:
    """Rank 0's side channel, as the producer computes it (one rank per server here)."""
    return port_for(conf.base_port, PURPOSE_SERVE, conf.stage_offset, 0, 1, 0)


def k8s_servers() -> dict[str, tuple[dict, dict, list[str]]]:
    """k8s workload name -> (the workload, its container, the server's argv)."""
    out = {}
    for d in docs():
        if d["kind"] in ("Deployment", "StatefulSet"):
            (c,) = d["spec"]["template"]["spec"]["containers"]
            argv = server_argv(k8s_argv(c))
            if "serve" in argv[:3]:
                out[d["metadata"]["name"]] = (d, c, argv)
    return out


def ucx_range(env: dict[str, str]) -> range:
    first, last = map(int, env["UCX_TCP_PORT_RANGE"].split("-"))
    return range(first, last + 1)


@pytest.mark.parametrize("doc", docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_validates_against_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_compose_validates_and_still_publishes_only_the_gateways():
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                          "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    published = {n for n, s in services().items() if s.get("ports")}
    assert published == {"gateway", "gateway-kv", "prometheus"}


def test_compose_every_consumer_lists_the_encoder_under_the_name_it_binds_and_announces():
    svc = services()
    producer = ec_conf(shlex.split(svc["encoder"]["command"]))
    assert producer.tiers[0] == "nixl" and "mooncake_store" not in producer.tiers
    announced = f"{producer.host}:{side_channel(producer)}"
    # the name is a compose service on the consumers' network, one container (no --scale)
    assert producer.host in svc and "data-plane" in svc[producer.host]["networks"]
    assert "deploy" not in svc[producer.host] and "scale" not in svc[producer.host]
    for name in ("prefill-decode", "prefill", "decode"):
        consumer = ec_conf(shlex.split(svc[name]["command"]))
        assert consumer.tiers == producer.tiers, name
        assert consumer.producers == [announced], name
        # the consumer's guard keeps a location the params name only if it is a producer
        assert pull_location(announced, consumer.producers) == announced, name
    assert pull_location("10.0.0.9:15500", consumer.producers) == ""  # an IP is refused


def test_compose_declares_every_port_and_sets_ucx_off_loopback():
    svc = services()
    producer = ec_conf(shlex.split(svc["encoder"]["command"]))
    side = side_channel(producer)
    for name in VLLM:
        env = svc[name]["environment"]
        assert env["UCX_NET_DEVICES"] not in ("", "lo") and env["UCX_TLS"], name
        declared = {int(p) for p in svc[name]["expose"]}
        assert set(ucx_range(env)) <= declared, name
        assert env["EPD_SECRET_FILE"] == "/run/secrets/epd_secret", name
        assert svc[name]["secrets"] == ["epd_secret"], name
        assert svc[name]["networks"] == ["data-plane"], name
    assert {side, announce_port(side)} <= {int(p) for p in svc["encoder"]["expose"]}
    assert not ({side, announce_port(side)} & set(ucx_range(svc["encoder"]["environment"])))


def test_compose_has_no_store_master_left_behind():
    doc = yaml.safe_load(COMPOSE.read_text())
    assert "mooncake-master" not in doc["services"]
    assert "mooncake-master" not in json.dumps(doc)  # no server waits for it or depends on it
    mounted = doc["services"]["prometheus"]["volumes"][0]
    assert mounted.startswith("./deploy/prometheus/prometheus.nixl.yml:")
    prom = (ROOT / "deploy" / "prometheus" / "prometheus.nixl.yml").read_text()
    assert "mooncake-master" not in prom and "job_name: encoder" in prom


def test_k8s_encoders_are_named_pods_every_consumer_lists_up_to_the_autoscalers_maximum():
    servers = k8s_servers()
    sts, c, argv = servers["epd-encoder"]
    assert sts["kind"] == "StatefulSet"
    producer = ec_conf(argv)
    side = side_channel(producer)
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # the headless Service gives each pod the name its side channel binds and announces
    (peers,) = [d for d in docs() if d["kind"] == "Service"
                and d["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["publishNotReadyAddresses"] is True  # it binds the name before ready
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert peers["spec"]["selector"].items() <= labels.items()
    assert producer.host == f"$(POD_NAME).{peers['metadata']['name']}"
    (hpa,) = [d for d in docs() if d["kind"] == "HorizontalPodAutoscaler"
              and d["spec"]["scaleTargetRef"]["name"] == "epd-encoder"]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(hpa["spec"]["maxReplicas"])]
    announced = [f"{producer.host.replace('$(POD_NAME)', p)}:{side}" for p in pods]
    consumers = [n for n in servers if n != "epd-encoder"]
    assert sorted(consumers) == ["epd-decode", "epd-prefill", "epd-prefill-decode"]
    for name in consumers:
        consumer = ec_conf(servers[name][2])
        assert consumer.tiers == producer.tiers, name
        assert consumer.producers == announced, name  # every pod the autoscaler may start
        for endpoint in announced:
            assert pull_location(endpoint, consumer.producers) == endpoint


def test_k8s_declares_every_port_mounts_the_secret_and_sets_ucx_off_loopback():
    servers = k8s_servers()
    for name, (d, c, _) in servers.items():
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UCX_NET_DEVICES"] not in (None, "", "lo") and env["UCX_TLS"], name
        declared = {p["containerPort"] for p in c["ports"]}
        assert set(ucx_range(env)) <= declared, name
        assert env["EPD_SECRET_FILE"] == "/var/run/epd/secret", name
        pod = d["spec"]["template"]["spec"]
        assert {"name": "epd-secret", "mountPath": "/var/run/epd", "readOnly": True} in \
            c["volumeMounts"], name
        assert {"name": "epd-secret", "secret": {"secretName": "epd-secret",
                                                 "defaultMode": 0o400}} in pod["volumes"], name
        assert "MC_TCP_BIND_ADDRESS" not in env  # no Mooncake here
    _, c, argv = servers["epd-encoder"]
    side = side_channel(ec_conf(argv))
    assert {side, announce_port(side)} <= {p["containerPort"] for p in c["ports"]}
    (peers,) = [d for d in docs() if d["kind"] == "Service"
                and d["metadata"]["name"] == "epd-encoder-peers"]
    assert {p["port"] for p in peers["spec"]["ports"]} == {side, announce_port(side)}
    # the data plane admits EPD pods on every port; no master role is left in it
    (policy,) = [d for d in docs() if d["metadata"]["name"] == "epd-data-plane"]
    roles = {v for e in policy["spec"]["podSelector"]["matchExpressions"] if e["key"] == "role"
             for v in e["values"]}
    assert roles == {"encoder", "pd", "prefill", "decode"}
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels":
                                                                    {"app": "epd"}}}]}]
    assert not [d for d in docs() if "mooncake-master" in json.dumps(d)]


def test_the_default_files_stay_without_nixl():
    text = (ROOT / "docker-compose.yml").read_text() + (ROOT / "deploy" / "k8s" /
                                                        "epd.yaml").read_text()
    assert "UCX_" not in text and '"transport":["mooncake_store","safetensors"]' in text


def test_render_refuses_colliding_ports_and_a_store_tier():
    render = _render_module()
    s = render.load_settings()
    side = s["nixl"]["side_channel"]
    s["nixl"]["ucx_tcp_ports"] = [announce_port(side) - 2, announce_port(side) + 2]
    with pytest.raises(ValueError, match="ucx_tcp_ports"):
        render.render(s)
    s = render.load_settings()
    s["nixl"]["side_channel"] = s["ports"]["vllm"]
    with pytest.raises(ValueError, match="side_channel"):
        render.render(s)
    s = render.load_settings()
    s["nixl"]["transport"] = ["nixl", "mooncake_store"]
    with pytest.raises(ValueError, match="mooncake_store"):
        render.render(s)


def test_a_nixl_setting_reaches_both_files():
    render = _render_module()
    s = render.load_settings()
    s["nixl"].update(side_channel=15700, ucx_tcp_ports=[19600, 19603], ucx_net_devices="ens5")
    s["autoscaling"]["encoders_max"] = 2
    out = {p.name: t for p, t in render.render(s).items()}
    compose = yaml.safe_load(out["docker-compose.nixl.yml"])["services"]
    assert ec_conf(shlex.split(compose["decode"]["command"])).producers == ["encoder:15700"]
    assert compose["encoder"]["environment"]["UCX_NET_DEVICES"] == "ens5"
    assert {"15700", "16700", "19603"} <= set(compose["encoder"]["expose"])
    k8s = [d for d in yaml.safe_load_all(out["epd-nixl.yaml"]) if d]
    (pd,) = [d for d in k8s if d["metadata"]["name"] == "epd-prefill-decode"
             and d["kind"] == "Deployment"]
    (c,) = pd["spec"]["template"]["spec"]["containers"]
    assert ec_conf(server_argv(k8s_argv(c))).producers == [
        "epd-encoder-0.epd-encoder-peers:15700", "epd-encoder-1.epd-encoder-peers:15700"]
    assert [p["containerPort"] for p in c["ports"]] == [8000, 19600, 19601, 19602, 19603]
