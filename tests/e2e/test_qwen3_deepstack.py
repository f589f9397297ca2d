"""Qwen3-VL (tiny, built locally) over the Mooncake Transfer Engine (TCP loopback): its
DeepStack encoder output is twice as wide as the language model's hidden size, and the
decode instance gets metadata-only image and video parts (video metadata includes
timestamps). The reference answer: the consumer itself given the raw media under another id
(not in the transport: it encodes the item itself, as an aggregated server does). Both servers
run with `--media-io-kwargs` for video, as a deployment serving long clips does: vLLM would
name such items by a hash of uuid and settings; the server guard keeps the uuid
(ec_connectors/guard/item_ids.py), so the metadata-only video is found under the id it was sent
with."""

from __future__ import annotations

import json

import httpx
import pytest

from encoder_service.local.processes import VllmServer, start_all
from encoder_service.local.requests import (
    image_part,
    sample_frames,
    sample_image_png,
    video_part,
)
from encoder_service.local.testmodels import SPECS, build
from encoder_service.local.up import epd_config
from tests.e2e.client import answer_parts, ask_parts, metric
from tests.helpers import LOOPBACK, MOONCAKE, WORK, port_block, stop_all, wait_for

pytest.importorskip("mooncake.engine")
SPEC = SPECS["qwen3-vl"]
MODEL = SPEC.model_name
BASE_PORT, MC_BASE_PORT = port_block(__name__)[0], port_block(__name__, MOONCAKE)[0]


def extra(**more) -> dict:
    return {"transport": "mooncake", "protocol": "tcp", "host": "127.0.0.1",
            "base_port": MC_BASE_PORT, "memory_pool_bytes": 128 << 20, "load_timeout_s": 10,
            "inline_max_bytes": 0, **more}  # every item through the transfer engine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = build(WORK / "models" / MODEL, SPEC)
    unused = tmp_path_factory.mktemp("unused")
    logs = WORK / "test-e2e-qwen3"
    settings = ["--media-io-kwargs", json.dumps({"video": {"num_frames": 16}})]
    prod = VllmServer("producer", model, BASE_PORT + 1, logs,
                      epd_config("ec_producer", unused, extra()), cpu_core=0, env=LOOPBACK,
                      served_name=MODEL, extra_args=settings)
    cons = VllmServer("consumer", model, BASE_PORT + 2, logs,
                      epd_config("ec_consumer", unused,
                                 extra(producers=[f"127.0.0.1:{MC_BASE_PORT}"])),
                      cpu_core=1, env=LOOPBACK, served_name=MODEL, extra_args=settings)
    try:
        start_all([prod, cons], progress=lambda m: print(f"[e2e-q3] {m}", flush=True))
        with httpx.Client(timeout=120) as client:
            yield {"prod": prod, "cons": cons, "client": client}
    finally:
        stop_all((prod, cons))


@pytest.mark.parametrize("modality", ["image", "video"])
def test_metadata_only_deepstack_items_equal_the_aggregated_answer(cluster, modality):
    c = cluster
    part = (image_part(sample_image_png(700)) if modality == "image"
            else video_part(sample_frames(701)))
    part["uuid"] = f"q3-{modality}"
    params = ask_parts(c, c["prod"], [part], MODEL, max_tokens=1)["ec_transfer_params"]
    entry = params["epd"]["items"][part["uuid"]]
    if "shape" in entry:  # described once the save is reported (usually already)
        assert entry["shape"][1] == 2 * SPEC.lm_hidden  # DeepStack: wider than the LM
    metadata = entry["metadata"]
    assert f"{modality}_grid_thw" in metadata
    if modality == "video":
        assert "timestamps" in metadata
    kind = f"{modality}_embeds"
    meta_only = [{"type": kind, kind: metadata, "uuid": part["uuid"]}]
    loads = metric(c, "loads_total")
    got = ask_parts(c, c["cons"], meta_only, MODEL, ec_transfer_params=params)
    local = {**part, "uuid": f"q3-{modality}-encoded-here"}
    reference = answer_parts(c, c["cons"], [local], MODEL)
    assert reference and got["choices"][0]["token_ids"] == reference
    # the embedding came through the transport (vLLM publishes the counter a step later)
    assert wait_for(lambda: metric(c, "loads_total") >= loads + 1, 15, 0.2)
