"""docker-compose.nixl.yml for real, under podman-compose: the NIXL variant (deploy/render.py,
[nixl]) started as a user would, the gateway published on 127.0.0.1. Through that port: two
images and a video answered; the prefill/decode container took every item from the encoder
container over NIXL (its `nixl` tier's hits; none from the volume, no local encode), so the
encoder's name, its side channel and announcements, UCX on the container's
interface and the deployment secret all worked across containers. Then the stack is stopped:
NIXL 1.5.1 segfaults as a process with an agent exits (docs/deploy.md), which would show in
the servers' exit codes and is reported, not failed; everything is removed whatever happens.

Starts vLLM servers: run it under the machine-wide lock (`./run.sh test-deploy` does).

It once failed in half the runs (every item from the volume: the prefill/decode worker's
spin between empty steps starved the encoder on this sandbox, docs/transports.md "A
spinning worker starved its encoder"); since `worker_spin_s` every item must come over NIXL."""

from __future__ import annotations

import time

import pytest

from encoder_service.local.processes import metric_value
from tests.deploy import engine
from tests.deploy.test_compose_stack import (  # noqa: F401 - fixtures
    ask,
    client,
    compose_up,
    containers,
    logs,
    prepared,
    secret,
)
from tests.helpers import ROOT, port_block

PUBLISHED = port_block(__name__)[0]
COMPOSE_FILE = ROOT / "docker-compose.nixl.yml"
KINDS = ("image", "video", "image-while-down")  # new items: none stored before


def server_metrics(service: str) -> str:
    """A vLLM server's /metrics, read from inside the data plane (the gateway's container)."""
    gw = containers()["gateway"]["Id"]
    return engine.podman("exec", gw, "python", "-c",
                         "import httpx; print(httpx.get("
                         f"'http://{service}:8000/metrics', timeout=10).text)", timeout=60)


@pytest.fixture(scope="module")
def stack(prepared, secret, client):  # noqa: F811
    env = {**engine.engine_env(), "EPD_SECRET_PATH": str(secret),
           "EPD_GATEWAY_PUBLISH": f"127.0.0.1:{PUBLISHED}"}
    url = f"http://127.0.0.1:{PUBLISHED}"
    with compose_up(COMPOSE_FILE, env, client, url, tag="deploy nixl") as exe:
        yield {"url": url, "exe": exe, "env": env}


def test_the_decode_container_reads_items_from_the_encoder_over_nixl(stack, client):  # noqa: F811
    """Every item reaches the decode container over NIXL: none from the volume, none encoded
    locally, the encoder encoded them all."""
    for kind in KINDS:
        assert ask(client, stack["url"], kind)["token_ids"], kind
    pd = server_metrics("prefill-decode")
    hits = metric_value(pd, "vllm:epd_tier_nixl_hits_total")
    volume = metric_value(pd, "vllm:epd_tier_safetensors_hits_total")
    print(f"\n[deploy nixl] prefill-decode: nixl hits {hits}, volume hits {volume} of "
          f"{len(KINDS)} items, local encodes "
          f"{metric_value(pd, 'vllm:epd_local_encode_fallbacks_total')}")
    why = "\n".join(line for line in pd.splitlines() if "epd_tier" in line and "_bucket" not in
                    line) + "".join(f"\n--- {n}\n" + "\n".join(
                        line for line in logs(n, tail=400).splitlines()
                        if any(w in line for w in ("EPD", "nixl", "NIXL", "UCX", "rror")))
                        for n in ("encoder", "prefill-decode"))
    assert (hits, volume) == (len(KINDS), 0), why
    assert metric_value(pd, "vllm:epd_local_encode_fallbacks_total") == 0, why
    assert metric_value(client.get(stack["url"] + "/metrics").text,
                        'epd_gateway_items_total{outcome="encoded"}') >= len(KINDS)


def test_the_stack_stops_and_says_how_the_servers_exited(stack):
    """A stop is clean whatever NIXL does at exit: every container stops within the timeout
    (the servers' exit codes printed: 139 would be NIXL's known segfault at exit)."""
    t0 = time.monotonic()
    engine.run([stack["exe"], "--project-name", engine.PROJECT, "-f", COMPOSE_FILE, "stop",
                "--timeout", "30"], env=stack["env"], check=False, timeout=300)
    states = {name: (c["State"]["Status"], c["State"]["ExitCode"])
              for name, c in containers().items()}
    print(f"\n[deploy nixl] stopped in {time.monotonic() - t0:.0f} s: {states}")
    assert all(status == "exited" for status, _ in states.values()), states
