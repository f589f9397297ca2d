"""Checks of a running `epd up` shared by the e2e modules that start one (test_up.py,
test_tiered.py): its keys, its listeners, what its gateway counts."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
from pathlib import Path

import psutil

from ec_connectors.protocol import ports
from encoder_service.local.requests import sample_image_png
from encoder_service.local.up_config import UpConfig
from tests.e2e import fleets
from tests.e2e.client import MODEL_NAME, answer, metric_at
from tests.helpers import descendants, wait_for

HIT = 'epd_gateway_items_total{outcome="cache_hit"}'
ENCODED = 'epd_gateway_items_total{outcome="encoded"}'
FALLBACK = 'epd_gateway_items_total{outcome="fallback"}'
LOADS = "vllm:epd_loads_total"


def view(conf: dict, work: Path, log_path: Path, up_pid: int) -> dict:
    """What the checks below read of a running `epd up` of config `conf`."""
    up_cfg = UpConfig(**conf)
    urls = [f"http://127.0.0.1:{conf['base_port'] + 1 + i}"
            for i in range(up_cfg.encoders + up_cfg.decoders)]
    encs, decs = urls[:up_cfg.encoders], urls[up_cfg.encoders:]
    return {"gw": f"http://127.0.0.1:{conf['base_port']}", "enc": encs[0], "dec": decs[0],
            "encs": encs, "decs": decs, "log": log_path, "work": work,
            "procs": descendants(up_pid), "up_pid": up_pid, "servers": len(urls),
            "engine_range": ports.engine_env(up_cfg.fixed_ports, os.environ)}


def assert_keyed(client, d, secret: Path, pool: bool = False) -> None:
    """Every encoder and prefill/decode server refuses a call without the deployment's key
    (401), health stays open, and the key opens them."""
    key = fleets.bearer(secret)
    calls = [("dec", "POST", "/v1/chat/completions"), ("dec", "POST", "/v1/completions"),
             ("dec", "GET", "/v1/models"), ("dec", "POST", "/inference/v1/generate")]
    calls += ([("enc", "POST", "/v1/encode"), ("enc", "POST", "/v1/release"),
               ("enc", "GET", "/v1/stats")] if pool else
              [("enc", "POST", "/v1/chat/completions"), ("enc", "GET", "/v1/models")])
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "prompt": "hi", "max_tokens": 1, "items": [], "item_ids": ["x"]}
    for server, method, path in calls:
        for headers in ({}, {"authorization": "Bearer not-the-key"}):
            r = client.request(method, d[server] + path, json=body, headers=headers)
            assert r.status_code == 401, (server, path, r.status_code, r.text[:300])
    for server in ("enc", "dec"):
        assert client.get(d[server] + "/health").status_code == 200
    assert client.get(d["dec"] + "/v1/models", headers=key).status_code == 200
    assert client.get(d["enc"] + ("/v1/stats" if pool else "/v1/models"),
                      headers=key).status_code == 200


# what the Transfer Engine logs about its two listeners (the Store client's engine too)
_TE_RPC = re.compile(rb"Transfer Engine RPC using [^,]+, listening on \S+:(\d+)")
_TE_TCP = re.compile(rb"TcpTransport: listen on port (\d+)")


def assert_listeners(d, engines: int,
                     library: frozenset[int] = frozenset()) -> set[tuple[str, int]]:
    """No listener of the stack on a wildcard address but the `engines` Mooncake engines'
    handshake and TCP data ports, exactly those its processes logged (two per engine), all
    in the port plan's engine range, and `library`: other ports Mooncake binds to every
    interface whatever it is told (docs/trust.md). The Transfer Engine transport over TCP
    starts no engine: with it alone, every listener is on loopback."""
    te_ports: set[int] = set()
    logged = 0
    for log in (d["work"] / "up" / "logs").glob("*.log"):
        text = log.read_bytes()
        logged += len(_TE_RPC.findall(text))
        for pattern in (_TE_RPC, _TE_TCP):
            te_ports.update(int(m) for m in pattern.findall(text))
    listening: list[tuple[int, str, int]] = []
    for pid in d["procs"] | {d["up_pid"]}:
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(pid).net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    listening.append((pid, c.laddr.ip, c.laddr.port))
    wildcard = {port for _, ip, port in listening if ipaddress.ip_address(ip).is_unspecified}
    others = {(ip, port) for _, ip, port in listening if port not in wildcard}
    assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in others), others
    assert logged == engines and len(te_ports) == 2 * engines, (logged, te_ports)
    first, last = (int(v) for v in d["engine_range"].values())
    assert all(first <= p <= last for p in te_ports), (te_ports, first, last)
    assert wildcard == te_ports | library, (wildcard, te_ports, library)
    port = int(d["gw"].rsplit(":", 1)[1])
    # the gateway and every server: on loopback
    assert set(range(port, port + d["servers"] + 1)) <= {p for _, p in others}
    return others


OVERLAPPED = 'epd_gateway_items_total{outcome="overlapped"}'


def assert_overlapped(client, d, agg, seed: int) -> None:
    """A new image goes to the decode instance while it is encoded, and the decode instance
    loads it (not encodes it) and answers as aggregated vLLM does."""
    image = sample_image_png(seed=seed)
    ref, loads = answer(client, agg.url, image), total(client, d["decs"], LOADS)
    overlapped = metric_at(client, d["gw"], OVERLAPPED)
    assert answer(client, d["gw"], image) == ref
    assert metric_at(client, d["gw"], OVERLAPPED) == overlapped + 1
    assert metric_at(client, d["gw"], FALLBACK) == 0
    assert wait_for(lambda: total(client, d["decs"], LOADS) >= loads + 1, timeout=5,
                    interval=0.1), "the decode instance did not load the embedding"


def total(client, urls: list[str], name: str) -> float:
    return sum(metric_at(client, u, name) for u in urls)


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def environ(pid: int) -> dict[bytes, bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.partition(b"=")[::2] for kv in f.read().split(b"\0") if kv)
    except OSError:
        return {}
