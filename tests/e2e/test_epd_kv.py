"""E/P/D end to end: `epd up --prefill 1 --decode 1` (a vLLM encoder, a prefill instance and a
decode instance, both EC consumers with vLLM's NixlConnector on cpu buffers, the gateway in
front; tiny LLaVA, shared-directory embeddings) beside the session's aggregated vLLM server.
An image request through the gateway answers the aggregated server's greedy tokens; the
decode instance's own metrics show it loaded the prompt's KV cache (vLLM's
prompt_tokens_by_source: external_kv_transfer, at most the last token computed) and neither
encoded nor loaded the image (EPDConnector: no load, no local encode; the prefix it was
handed covers the item); the gateway counts one handoff and no failure; a streamed answer is
the same too. Then the prefill
instance is killed: the next request is still answered exactly, the decode instance computing
the prompt itself, the failed handoff logged and counted."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal

import httpx
import psutil
import pytest

from encoder_service.local.requests import chat_body, sample_image_png
from encoder_service.local.testmodels import SPECS, build
from tests.e2e.client import MODEL_NAME, PROMPT, answer, metric_at
from tests.helpers import WORK, descendants, epd_up, port_block, wait_for

pytest.importorskip("nixl._api")
# gateway, encoder +1, decode +2, prefill +3, NIXL side channels +4 +5
BASE = port_block(__name__)[0]
DECODE = f"http://127.0.0.1:{BASE + 2}"


def by_source(text: str, source: str) -> float:
    """vllm:prompt_tokens_by_source_total{source=...} in a /metrics text."""
    pattern = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="'
                         + source + r'"[^}]*\} (\S+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


def streamed(c, url: str, image: bytes) -> list[int]:
    """The token ids of a streamed greedy answer."""
    body = {**chat_body(MODEL_NAME, image, PROMPT), "stream": True, "return_token_ids": True}
    ids: list[int] = []
    with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or ():
                    ids += choice.get("token_ids") or []
    return ids


def kill_server(root: int, port: int) -> None:
    """SIGKILL the session of the vLLM server under `root` that serves `port`."""
    for pid in descendants(root):
        with contextlib.suppress(psutil.Error):
            cmd = psutil.Process(pid).cmdline()
            if "serve" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] == str(port):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                return
    raise AssertionError(f"no server on port {port} under {root}")


def test_epd_up_prefill_decode_hands_the_kv_cache_over(aggregated):
    model = build(WORK / "models" / "tiny-llava", SPECS["tiny"])
    conf = {"model": str(model), "base_port": BASE, "transport": "safetensors",
            "cpu_cores": [0, 1, 1], "gateway": {"routing": {"probe_interval_s": 0}}}
    work = WORK / "test-epd-kv"
    with httpx.Client(timeout=120) as c, epd_up(
            conf, work, also_ready=aggregated.healthy,
            args=["--prefill", "1", "--decode", "1"]) as (up, gw, log):
        image = sample_image_png(seed=71)
        ref = answer(c, aggregated.url, image)
        assert answer(c, gw, image) == ref
        text = lambda: c.get(DECODE + "/metrics").text  # noqa: E731
        assert wait_for(lambda: by_source(text(), "external_kv_transfer") > 0, timeout=10,
                        interval=0.2), "the decode instance loaded no KV cache"
        m = text()
        external, local = by_source(m, "external_kv_transfer"), by_source(m, "local_compute")
        assert external >= 64 and local <= 1, (external, local)  # 64 image tokens at least
        for name in ("vllm:epd_loads_total", "vllm:epd_local_encode_fallbacks_total"):
            assert metric_at(c, DECODE, name) == 0, name
        assert metric_at(c, gw, "epd_kv_handoffs_total") == 1
        assert metric_at(c, gw, "epd_kv_handoff_failures_total") == 0
        # streamed: the same tokens, a second handoff
        assert streamed(c, gw, sample_image_png(seed=73)) == answer(
            c, aggregated.url, sample_image_png(seed=73))
        assert metric_at(c, gw, "epd_kv_handoffs_total") == 2
        # the prefill instance killed: no handoff, the decode instance computes the prompt
        kill_server(up.pid, BASE + 3)
        image = sample_image_png(seed=72)
        assert answer(c, gw, image) == answer(c, aggregated.url, image)
        assert metric_at(c, gw, "epd_kv_handoff_failures_total") == 1
        assert wait_for(lambda: by_source(text(), "local_compute") > local, timeout=10,
                        interval=0.2), "the decode instance did not compute the prompt"
        assert "kv handoff failed" in log.read_text()
