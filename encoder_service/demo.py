"""`epd demo`: a vLLM encoder-only producer and a vLLM prefill/decode consumer on the tiny
model, EPDConnector over the safetensors transport, one image chat request through both."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx

from encoder_service.launcher import VllmServer, metric_value, start_all
from encoder_service.media import chat_body, content_item_id, sample_image_png

MODEL_NAME = "tiny-llava"


def epd_config(role: str, storage: Path) -> dict:
    return {
        "ec_connector": "EPDConnector",
        "ec_role": role,
        "ec_buffer_device": "cpu",
        "ec_connector_extra_config": {"transport": "safetensors", "storage_path": str(storage)},
    }


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def run_demo(work_dir: Path, model: Path, prompt: str, base_port: int = 18100) -> int:
    storage = work_dir / "demo" / "ec-cache"
    shutil.rmtree(storage, ignore_errors=True)
    producer = VllmServer("encoder", model, base_port, work_dir / "demo",
                          epd_config("ec_producer", storage), cpu_core=0)
    consumer = VllmServer("prefill-decode", model, base_port + 1, work_dir / "demo",
                          epd_config("ec_consumer", storage), cpu_core=1)
    say("starting an encoder-only vLLM producer and a vLLM consumer (EPDConnector, safetensors)")
    start_all([producer, consumer], progress=say)
    try:
        image = sample_image_png(seed=7)
        item_id = content_item_id(image, MODEL_NAME)
        with httpx.Client(timeout=120) as client:
            t0 = time.perf_counter()
            r = client.post(producer.url + "/v1/chat/completions",
                            json=chat_body(MODEL_NAME, image, prompt, item_id=item_id,
                                           max_tokens=1))
            r.raise_for_status()
            params = r.json().get("ec_transfer_params")
            t_enc = time.perf_counter() - t0
            say(f"encoder: embedded image {item_id[:16]}... in {t_enc * 1e3:.0f} ms; "
                f"ec_transfer_params={json.dumps(params)[:200]}")
            loads = "vllm:epd_loads_total"
            before = metric_value(client.get(consumer.url + "/metrics").text, loads)
            t0 = time.perf_counter()
            r = client.post(consumer.url + "/v1/chat/completions",
                            json=chat_body(MODEL_NAME, image, prompt, item_id=item_id,
                                           max_tokens=16, ec_transfer_params=params))
            r.raise_for_status()
            answer = r.json()["choices"][0]
            t_dec = time.perf_counter() - t0
            time.sleep(1.0)  # vLLM publishes connector stats with the next metrics update
            after = metric_value(client.get(consumer.url + "/metrics").text, loads)
        source = ("loaded from the encoder's output over the safetensors transport"
                  if after > before else "encoded locally by the consumer (fallback)")
        say(f"answer ({t_dec * 1e3:.0f} ms, first request includes warm-up): "
            f"{answer['message']['content']!r} (random-weight test model: the text is noise, "
            "the tests compare token ids with an aggregated server)")
        say(f"token ids: {answer.get('token_ids')}")
        say(f"the consumer's image embedding was {source} "
            f"(vllm:epd_loads_total {before:.0f} -> {after:.0f})")
        return 0
    finally:
        say("stopping servers")
        producer.stop()
        consumer.stop()
