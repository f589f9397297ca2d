"""docker-compose.yml for real, under podman-compose (tests/deploy/engine.py): the image built
from the Dockerfile on a debootstrapped base, the stack started as a user would (model-init
builds the tiny Qwen2.5-Omni model, the master, a vLLM encoder, a vLLM prefill/decode
instance, the gateway), only the gateway published (on 127.0.0.1 here). Checked through that
port alone: an image, a video and an audio request answered, each equal (greedy tokens) to the
same request through `epd up` on the same model; the data plane not reachable from outside its
network; a vLLM server refusing a call without the deployment's key from inside the network;
a SIGKILLed encoder container restarted by its policy while requests are still answered. The
stack runs with its `monitoring` profile: Prometheus (an image built from deploy/prometheus/
on the lane's base) publishes on 127.0.0.1 only and has every service's /metrics up.
Everything is taken down (containers, networks, volumes) whatever happens.

Starts vLLM servers: run it under the machine-wide lock (`./run.sh test-deploy` does)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
import yaml

from ec_connectors.protocol.api_keys import api_key
from ec_connectors.protocol.secret_file import read_secret
from encoder_service.local.processes import metric_value
from encoder_service.local.requests import (
    audio_part,
    image_part,
    parts_body,
    sample_frames,
    sample_image_png,
    sample_wav,
    video_part,
)
from encoder_service.local.testmodels import SPECS
from tests.deploy import engine
from tests.helpers import ROOT, epd_up, port_block, wait_for

UP_PORT = port_block(__name__)[0]  # the `epd up` reference: gateway; encoder +1, decode +2
PUBLISHED = UP_PORT + 3  # the compose stack's gateway on the host (127.0.0.1)
PROM_PUBLISHED = UP_PORT + 4  # its Prometheus (profile monitoring) on the host (127.0.0.1)
# the default stack's services that serve /metrics: Prometheus' jobs (prometheus.yml)
SCRAPED = {"gateway", "encoder", "prefill-decode", "mooncake-master"}
MODEL = SPECS[engine.settings()["model"]["spec"]]
PROMPT = "describe this"
MAX_TOKENS = 8
# images first sent while the encoder is down, and after its restart (new to the cache)
REQUESTS = {"image": image_part(sample_image_png(seed=7)),
            "video": video_part(sample_frames(seed=8)),
            "audio": audio_part(sample_wav(seed=9)),
            "image-while-down": image_part(sample_image_png(seed=10)),
            "image-after-restart": image_part(sample_image_png(seed=11))}
ENCODED = 'epd_gateway_items_total{outcome="encoded"}'
START_S = 600  # vLLM on 2 shared cores, in containers: ~1-3 min; a bound, not an estimate


def ask(client: httpx.Client, url: str, kind: str) -> dict:
    r = client.post(url + "/v1/chat/completions",
                    json=parts_body(MODEL.model_name, [REQUESTS[kind]], PROMPT,
                                    max_tokens=MAX_TOKENS))
    assert r.status_code == 200, (kind, r.status_code, r.text[:500])
    choice = r.json()["choices"][0]
    return {"text": choice["message"]["content"], "token_ids": choice.get("token_ids")}


def healthy(client: httpx.Client, url: str) -> bool:
    """The gateway answers and sees its encoder and decode instance healthy."""
    try:
        r = client.get(url + "/health", timeout=5)
    except httpx.HTTPError:
        return False
    body = r.json() if r.status_code in (200, 503) else {}
    return r.status_code == 200 and all(body.get("encoders", {"": False}).values()) and \
        all(body.get("decoders", {"": False}).values())


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=180) as c:
        yield c


def prometheus_image() -> str:
    name = yaml.safe_load(engine.COMPOSE_FILE.read_text())["services"]["prometheus"]["image"]
    return name if "/" in name else f"localhost/{name}"


def build_prometheus_image() -> float:
    """The monitoring profile's image: Debian's prometheus on the lane's base (no registry
    image can be pulled here); cached layers."""
    t0 = time.monotonic()
    out = engine.run(["podman", "build", "--layers", "--pull=never", "--build-arg",
                      f"BASE={engine.base_image()}", "-t", prometheus_image(),
                      ROOT / "deploy" / "prometheus"], check=False, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def prepared():
    """The engine, the base image, the image and Prometheus' (cached: seconds when nothing
    changed)."""
    out = engine.prepare()
    prom_s = build_prometheus_image()
    print(f"\n[deploy] install {out['install_s']:.0f} s, base {out['base_s']:.0f} s, image "
          f"build {out['build_s']:.0f} s, image {out['image_bytes'] / 1e9:.2f} GB, "
          f"prometheus image {prom_s:.0f} s")
    return out


@pytest.fixture(scope="module")
def secret():
    path = engine.DEPLOY_WORK / "secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def model_dir(prepared):
    """The model as the image builds it (what model-init puts in the volume), for `epd up`."""
    out = engine.DEPLOY_WORK / "model"
    out.mkdir(parents=True, exist_ok=True)
    engine.podman("run", "--rm", "--label", engine.LABEL, "--network", "none",
                  "-v", f"{out}:/out", engine.image_name(), "epd", "build-model", "--spec",
                  MODEL.name, "--out", f"/out/{MODEL.model_name}", timeout=300)
    return out / MODEL.model_name


@pytest.fixture(scope="module")
def reference(model_dir, secret, client):
    """The same requests through `epd up` (the project's local stack) on the same model."""
    conf = {"model": str(model_dir), "served_name": MODEL.model_name, "base_port": UP_PORT,
            "cpu_cores": [0, 1], "secret_file": str(secret)}
    url = f"http://127.0.0.1:{UP_PORT}"
    with epd_up(conf, engine.DEPLOY_WORK / "epd-up", also_ready=lambda: healthy(client, url),
                interval=1.0, stop_timeout=120):
        return {kind: ask(client, url, kind) for kind in REQUESTS}


def containers() -> dict[str, dict]:
    """The stack's containers by compose service, as podman inspects them."""
    ids = engine.podman("ps", "-a", "-q", "--filter",
                        f"label=io.podman.compose.project={engine.PROJECT}").split()
    if not ids:
        return {}
    info = json.loads(engine.podman("inspect", *ids))
    return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in info}


@contextlib.contextmanager
def compose_up(compose_file: Path, env: dict[str, str], client: httpx.Client, url: str,
               profiles: tuple[str, ...] = (), tag: str = "deploy"):
    """`podman-compose [--profile P] up -d` of `compose_file` under the lane's project, ready
    (the gateway at `url` healthy; a server that exited for good fails at once); down and
    checked gone after, whatever happens. Yields the compose executable."""
    exe = engine.compose_bin()
    engine.clean(exe)  # a previous run killed before its teardown
    t0 = time.monotonic()
    try:
        up = engine.run([exe, "--project-name", engine.PROJECT, "-f", compose_file,
                         *(a for p in profiles for a in ("--profile", p)), "up", "-d"],
                        env=env, check=False, timeout=900)
        assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]

        def ready() -> bool:
            for name, c in containers().items():
                if name != "model-init" and c["State"]["Status"] == "exited" \
                        and c["HostConfig"]["RestartPolicy"]["Name"] == "no":
                    raise RuntimeError(f"{name} exited: {logs(name)}")
            return healthy(client, url)

        ok = wait_for(ready, timeout=START_S, interval=2.0)
        assert ok, f"stack not ready in {START_S} s: " + "\n".join(
            f"--- {n}\n{logs(n)}" for n in containers())
        print(f"\n[{tag}] compose stack ready in {time.monotonic() - t0:.0f} s")
        yield exe
    finally:
        left = engine.clean(exe)
        assert not left, f"left behind: {left}"


@pytest.fixture(scope="module")
def stack(prepared, reference, secret, client):
    """docker-compose.yml with its `monitoring` profile, ready; down (and checked gone)
    after. Starts after the reference has stopped: one vLLM stack at a time."""
    env = {**engine.engine_env(), "EPD_SECRET_PATH": str(secret),
           "EPD_GATEWAY_PUBLISH": f"127.0.0.1:{PUBLISHED}",
           "EPD_PROMETHEUS_PUBLISH": f"127.0.0.1:{PROM_PUBLISHED}"}
    url = f"http://127.0.0.1:{PUBLISHED}"
    with compose_up(engine.COMPOSE_FILE, env, client, url, profiles=("monitoring",)):
        yield {"url": url, "env": env, "secret": secret}


def logs(service: str, tail: int = 40) -> str:
    c = containers().get(service)
    if c is None:
        return "(no container)"
    return engine.run(["podman", "logs", "--tail", str(tail), c["Id"]], check=False).stdout


def test_image_video_and_audio_answered_through_the_gateway_as_epd_up_answers(
        stack, reference, client):
    for kind in ("image", "video", "audio"):
        got = ask(client, stack["url"], kind)
        assert got == reference[kind], (kind, got, reference[kind])
        assert got["token_ids"], kind  # token ids compared, not only the text
    metrics = client.get(stack["url"] + "/metrics").text
    assert metric_value(metrics, ENCODED) >= 3  # the encoder container encoded them


def test_prometheus_has_every_service_of_the_stack_up(stack, client):
    """The monitoring profile: through its published port (127.0.0.1), `up` is 1 for every
    target, and the targets are every service that serves /metrics (one job each)."""
    url = f"http://127.0.0.1:{PROM_PUBLISHED}/api/v1/query"
    got: dict[str, list[str]] = {}

    def all_up() -> bool:
        got.clear()
        try:
            result = client.get(url, params={"query": "up"}, timeout=10).json()["data"]["result"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        for r in result:
            got.setdefault(r["metric"]["job"], []).append(r["value"][1])
        return set(got) == SCRAPED and all(v == ["1"] for v in got.values())

    t0 = time.monotonic()
    assert wait_for(all_up, timeout=120, interval=2.0), \
        f"up by job: {got}\n{logs('prometheus')}"
    print(f"\n[deploy] prometheus: every target up ({sorted(got)}) after "
          f"{time.monotonic() - t0:.0f} s")


def _tcp_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_only_the_gateway_is_published(stack):
    cs = containers()
    bound = {name: {p: [(b["HostIp"], b["HostPort"]) for b in (binds or [])]
                    for p, binds in (c["NetworkSettings"]["Ports"] or {}).items() if binds}
             for name, c in cs.items()}
    assert bound.pop("gateway") == {"8000/tcp": [("127.0.0.1", str(PUBLISHED))]}
    # and Prometheus (profile monitoring), on loopback as it is by default
    assert bound.pop("prometheus") == {"9090/tcp": [("127.0.0.1", str(PROM_PUBLISHED))]}
    assert all(not b for b in bound.values()), bound
    # a container outside the data-plane network (on the published `clients` network, where
    # only the gateway also is) reaches the gateway but none of the servers nor the master
    targets = {name: next(iter(n["IPAddress"] for k, n in
                               cs[name]["NetworkSettings"]["Networks"].items()
                               if k.endswith("data-plane")))
               for name in ("encoder", "prefill-decode", "mooncake-master")}
    probes = [(ip, 50051 if name == "mooncake-master" else 8000)
              for name, ip in targets.items()]
    probes.append(("gateway", 8000))
    script = ("import socket,sys,json; out=[]\n"
              "for h,p in json.loads(sys.argv[1]):\n"
              "    try: socket.create_connection((h,p),3).close(); out.append(True)\n"
              "    except OSError: out.append(False)\n"
              "print(json.dumps(out))")
    clients = f"{engine.PROJECT}_clients"
    out = engine.podman("run", "--rm", "--label", engine.LABEL, "--network", clients,
                        engine.image_name(), "python", "-c", script, json.dumps(probes),
                        timeout=120)
    reached = json.loads(out.strip().splitlines()[-1])
    assert reached == [False] * len(targets) + [True], \
        dict(zip(map(str, probes), reached, strict=True))
    # The host itself sits on every bridge network it runs (podman and docker alike: the
    # bridge's address is the network's gateway and DNS server), so root on this machine
    # can still dial a container's address: measured and said, not a published port.
    from_host = {name: _tcp_open(ip, port)
                 for (ip, port), name in zip(probes, targets, strict=False)}
    print(f"\n[deploy] data-plane addresses dialled from the host itself: {from_host}")


def test_a_vllm_server_refuses_a_call_without_the_key_from_inside_the_network(stack):
    """From the gateway's container (inside the data-plane network): 401 without the key or
    with another, 200 with the deployment's key, health open."""
    key = api_key(read_secret(stack["secret"]))
    script = (
        "import httpx,json,os\n"
        "key={'authorization': 'Bearer '+os.environ['KEY']}\n"
        "bad={'authorization': 'Bearer not-the-key'}\n"
        "body={'model':'m','messages':[{'role':'user','content':'hi'}],'max_tokens':1}\n"
        "out={}\n"
        "for s in ('encoder','prefill-decode'):\n"
        "    u='http://'+s+':8000'\n"
        "    out[s]=[httpx.post(u+'/v1/chat/completions',json=body).status_code,\n"
        "            httpx.get(u+'/v1/models').status_code,\n"
        "            httpx.get(u+'/v1/models',headers=bad).status_code,\n"
        "            httpx.get(u+'/health').status_code,\n"
        "            httpx.get(u+'/v1/models',headers=key).status_code]\n"
        "out['generate']=httpx.post('http://prefill-decode:8000/inference/v1/generate',"
        "json={}).status_code\n"
        "print(json.dumps(out))")
    gw = containers()["gateway"]["Id"]
    out = engine.run(["podman", "exec", "-e", "KEY", gw, "python", "-c", script],
                     env={**engine.engine_env(), "KEY": key}, timeout=120).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"encoder": [401, 401, 401, 200, 200],
                   "prefill-decode": [401, 401, 401, 200, 200], "generate": 401}, got


def test_a_killed_encoder_container_is_restarted_and_requests_are_still_answered(
        stack, reference, client):
    enc = containers()["encoder"]
    assert enc["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
    restarts0 = enc["RestartCount"]
    os.kill(enc["State"]["Pid"], signal.SIGKILL)  # a crash, not a `stop`: the policy applies
    t0 = time.monotonic()
    # while it is gone or starting, the gateway routes around it: what the shared volume
    # holds is loaded from there, a new image is encoded by the decode instance itself
    for kind in ("image", "video", "audio", "image-while-down"):
        assert ask(client, stack["url"], kind) == reference[kind], kind
    assert containers()["encoder"]["RestartCount"] == restarts0 or \
        not healthy(client, stack["url"])  # answered without it, not after it was back
    print(f"\n[deploy] answered while the encoder was down ({time.monotonic() - t0:.0f} s)")

    def back() -> bool:
        c = containers()["encoder"]
        return c["RestartCount"] > restarts0 and c["State"]["Status"] == "running" and \
            healthy(client, stack["url"])

    assert wait_for(back, timeout=START_S, interval=2.0), logs("encoder")
    print(f"[deploy] encoder restarted and healthy after {time.monotonic() - t0:.0f} s")
    encoded0 = metric_value(client.get(stack["url"] + "/metrics").text, ENCODED)
    kind = "image-after-restart"
    assert ask(client, stack["url"], kind) == reference[kind]
    encoded1 = metric_value(client.get(stack["url"] + "/metrics").text, ENCODED)
    assert encoded1 == encoded0 + 1  # the restarted encoder encoded it
