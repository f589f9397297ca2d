"""`epd demo`: start the local deployment, send sample requests, stop.

`epd demo` / `epd up --demo`: start the local deployment (`epd up`: a vLLM encoder, a vLLM
prefill/decode instance, EPDConnector over the transport `auto` picks, the gateway) on the tiny
Qwen2.5-Omni test model, send an image, a video and an audio request through the gateway, then
the same image again streamed (the gateway skips its encode where it can tell the item is
stored; with shared memory it cannot, and the encoder skips it), print what happened, stop
everything. With a model that takes metadata-only parts, the decode instance gets no media
bytes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from ec_connectors.protocol.ports import GATEWAY_PORT
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
from encoder_service.local.up import Deployment, run_up
from encoder_service.local.up_config import UpConfig

DEMO_MODEL = "qwen-omni"  # `epd up --demo` without --model / a config's model


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _gw_metric(client: httpx.Client, url: str, name: str) -> float:
    return metric_value(client.get(url + "/metrics").text, name)


def _samples(modalities: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    out = [("one 112x112 PNG image", image_part(sample_image_png(seed=7)))]
    if "video" in modalities:
        out.append(("a 4-frame JPEG video", video_part(sample_frames(seed=8))))
    if "audio" in modalities:
        out.append(("2 s of 16 kHz WAV audio", audio_part(sample_wav(seed=9))))
    return out


def demo_requests(dep: Deployment, prompt: str) -> int:
    """Send the demo's requests through the deployment's gateway.

    One request per modality the model takes, then the image again, through `dep`'s
    gateway."""
    url, consumer = dep.url, dep.decoders[0].url
    model = dep.cfg.served_model_name
    spec = dep.cfg.spec
    samples = _samples(spec.modalities if spec else ("image",))
    hits = 'epd_gateway_items_total{outcome="cache_hit"}'
    encoded = 'epd_gateway_items_total{outcome="encoded"}'
    meta_only = 'epd_gateway_items_total{outcome="metadata_only"}'
    loads = "vllm:epd_loads_total"
    with httpx.Client(timeout=120) as client:
        loads0 = metric_value(client.get(consumer + "/metrics").text, loads)
        answers = []
        for what, part in samples:
            say(f"POST {url}/v1/chat/completions ({what} as a data: URL + {prompt!r})")
            t0 = time.perf_counter()
            r = client.post(url + "/v1/chat/completions",
                            json=parts_body(model, [part], prompt, max_tokens=16))
            if r.status_code != 200:
                say(f"ERROR: the gateway answered HTTP {r.status_code}: {r.text[:500]}")
                return 1
            answer = r.json()["choices"][0]["message"]["content"]
            answers.append(answer)
            say(f"  answer in {(time.perf_counter() - t0) * 1e3:.0f} ms"
                f"{' (includes warm-up)' if len(answers) == 1 else ''}: {answer!r}")
        say("(random-weight test model: the text is noise; the tests compare token ids with "
            "an aggregated vLLM server)")
        say(f"gateway: items encoded by {dep.encoders[0].name if dep.encoders else 'nobody'}: "
            f"{_gw_metric(client, url, encoded):.0f}; sent to the decode instance as "
            f"metadata only (no media bytes): {_gw_metric(client, url, meta_only):.0f}")
        t0 = time.perf_counter()
        body = {**parts_body(model, [samples[0][1]], prompt, max_tokens=16), "stream": True}
        chunks = []
        with client.stream("POST", url + "/v1/chat/completions", json=body) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0].get("delta", {})
                    chunks.append(delta.get("content") or "")
        t2 = time.perf_counter() - t0
        same = "".join(chunks) == answers[0]
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
        say(f"the decode instance loaded the encoder's embeddings instead of encoding: "
            f"vllm:epd_loads_total {loads0:.0f} -> {loads1:.0f}")
    return 0 if same else 1


def run_demo(work_dir: Path, model: str, prompt: str, base_port: int = GATEWAY_PORT) -> int:
    """Run `epd demo` with the given model and ports.

    `epd demo`: the same as `epd up --demo` with the given model (a test model's name or
    a directory) and ports."""
    cfg = UpConfig(model=model, base_port=base_port)
    return run_up(cfg, work_dir, lambda dep: demo_requests(dep, prompt))
