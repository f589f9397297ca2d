"""Warm the e2e lane's caches while the fast lane runs: `./run.sh test` starts this niced
beside the fast lane and waits for it before the e2e lane. What a fresh clone otherwise pays
inside the e2e lane, one server at a time:
- vLLM's inspection of each model class its servers load (a fresh interpreter, ~7 s each,
  once per vLLM cache: the project's, shared by every test server);
- torch inductor's sampling kernels for the request fields the e2e tests send (a server
  compiles them at the first request that needs them, ~25 s for logprobs; the inductor cache
  is shared too).
Only caches: when anything here fails, the e2e lane pays that time itself, with the same
results. `python -m tests.prewarm`."""

from __future__ import annotations

import os
import sys
import time

import httpx

from encoder_service.local.processes import VllmServer, vllm_env
from encoder_service.local.requests import chat_body, sample_image_png
from encoder_service.local.testmodels import SPECS, build
from tests.e2e.client import FIELDS, MODEL_NAME, PROMPT
from tests.helpers import WORK, port_block

PORT = port_block(__name__ if __name__ != "__main__" else "tests.prewarm")[0]
# the model classes the e2e servers load (vLLM's names): tiny LLaVA, Qwen2.5-Omni, Qwen3-VL
CLASSES = ("LlavaForConditionalGeneration", "Qwen2_5OmniThinkerForConditionalGeneration",
           "Qwen3VLForConditionalGeneration")


def say(msg: str) -> None:
    print(f"[prewarm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def inspect_classes() -> None:
    os.environ["VLLM_CACHE_ROOT"] = vllm_env(WORK / "prewarm")["VLLM_CACHE_ROOT"]
    from vllm.model_executor.models.registry import ModelRegistry

    for name in CLASSES:
        # vLLM's own lookup: reads the cache, or inspects in a subprocess and writes it
        ModelRegistry._try_inspect_model_cls(name)
        say(f"model class {name} known to the cache")


def compile_sampling(model) -> None:
    # on one core, as every test server: inductor keys its kernels by the thread count
    server = VllmServer("prewarm", model, PORT, WORK / "prewarm", None, cpu_core=1).start()
    try:
        server.wait()
        with httpx.Client(timeout=120) as client:
            for n, (fields, _how) in enumerate(FIELDS):
                body = {**chat_body(MODEL_NAME, sample_image_png(seed=870 + n), PROMPT),
                        "temperature": 0.0, **fields, "stream": True}
                client.post(server.url + "/v1/chat/completions", json=body).raise_for_status()
        say("sampling kernels compiled")
    finally:
        server.stop()


def main() -> int:
    t0 = time.monotonic()
    failed = 0
    model = build(WORK / "models" / "tiny-llava", SPECS["tiny"])  # setup built it: found
    for step in (inspect_classes, lambda: compile_sampling(model)):
        try:
            step()
        except Exception as exc:  # a cache left cold: the e2e lane pays it, nothing else
            failed += 1
            say(f"left cold: {exc!r}")
    say(f"done in {time.monotonic() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
