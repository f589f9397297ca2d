"""`epd demo` / `epd up --demo`: start the local deployment (`epd up`: a vLLM encoder, a vLLM
prefill/decode instance, EPDConnector over the safetensors transport, the gateway), send a
real image request through the gateway, then the same image again streamed (it skips
encoding), print what happened, stop everything."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from ec_connectors.protocol.ports import GATEWAY_PORT
from encoder_service.local.processes import metric_value
from encoder_service.local.requests import chat_body, sample_image_png
from encoder_service.local.up import Deployment, UpConfig, run_up

MODEL_NAME = "tiny-llava"


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _gw_metric(client: httpx.Client, url: str, name: str) -> float:
    return metric_value(client.get(url + "/metrics").text, name)


def demo_requests(dep: Deployment, prompt: str) -> int:
    """Two requests through `dep`'s gateway."""
    url, consumer = dep.url, dep.decoders[0].url
    image = sample_image_png(seed=7)
    hits = 'epd_gateway_items_total{outcome="cache_hit"}'
    encoded = 'epd_gateway_items_total{outcome="encoded"}'
    loads = "vllm:epd_loads_total"
    with httpx.Client(timeout=120) as client:
        loads0 = metric_value(client.get(consumer + "/metrics").text, loads)
        say(f"POST {url}/v1/chat/completions (one 112x112 PNG as a data: URL + {prompt!r})")
        t0 = time.perf_counter()
        r = client.post(url + "/v1/chat/completions",
                        json=chat_body(MODEL_NAME, image, prompt, max_tokens=16))
        if r.status_code != 200:
            say(f"ERROR: the gateway answered HTTP {r.status_code}: {r.text[:500]}")
            return 1
        t1 = time.perf_counter() - t0
        answer = r.json()["choices"][0]
        say(f"answer in {t1 * 1e3:.0f} ms (first request includes warm-up): "
            f"{answer['message']['content']!r}")
        say("(random-weight test model: the text is noise; the tests compare token ids with "
            "an aggregated vLLM server)")
        say(f"gateway: image encoded by {dep.encoders[0].name if dep.encoders else 'nobody'} "
            f"(items encoded: {_gw_metric(client, url, encoded):.0f})")
        t0 = time.perf_counter()
        body = {**chat_body(MODEL_NAME, image, prompt, max_tokens=16), "stream": True}
        chunks = []
        with client.stream("POST", url + "/v1/chat/completions", json=body) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0].get("delta", {})
                    chunks.append(delta.get("content") or "")
        t2 = time.perf_counter() - t0
        same = "".join(chunks) == answer["message"]["content"]
        n_hits = _gw_metric(client, url, hits)
        kind = dep.gateway_cfg.availability.kind if dep.gateway_cfg is not None else "none"
        skipped = (f"encoding skipped (gateway cache hits: {n_hits:.0f})" if n_hits or
                   kind != "none" else "the gateway has no catalog of this transport "
                   "(availability none): the encoder was asked again (it skips the encode of an "
                   "item the store holds)")
        say(f"same image again, streamed: {len(chunks)} chunks in {t2 * 1e3:.0f} ms, "
            f"same text as before: {same}; {skipped}")
        time.sleep(1.0)  # vLLM publishes connector stats with its next metrics update
        loads1 = metric_value(client.get(consumer + "/metrics").text, loads)
        say(f"the decode instance loaded the encoder's embedding instead of encoding: "
            f"vllm:epd_loads_total {loads0:.0f} -> {loads1:.0f}")
    return 0 if same else 1


def run_demo(work_dir: Path, model: Path, prompt: str, base_port: int = GATEWAY_PORT) -> int:
    """`epd demo`: the same as `epd up --demo` with the given model and ports."""
    cfg = UpConfig(model=str(model), base_port=base_port)
    return run_up(cfg, work_dir, lambda dep: demo_requests(dep, prompt))
