"""Client helpers of the end-to-end tests: one request to a real server, its greedy tokens,
the reference answer of the aggregated server, the consumer's connector metrics.
`c` is a cluster dict of a module fixture: client, agg, prod, cons (VllmServer)."""

from __future__ import annotations

import threading
import time

from ec_connectors.protocol.keys import content_item_id
from encoder_service.local.processes import metric_value
from encoder_service.local.requests import chat_body, sample_image_png
from tests.helpers import wait_for

MODEL_NAME = "tiny-llava"
PROMPT = "what is in this picture"


def ask(c, server, image, item_id, params=None, max_tokens=8):
    r = c["client"].post(server.url + "/v1/chat/completions",
                         json=chat_body(MODEL_NAME, image, PROMPT, item_id=item_id,
                                        max_tokens=max_tokens, ec_transfer_params=params))
    assert r.status_code == 200, r.text
    return r.json()


def tokens(answer) -> list[int]:
    ids = answer["choices"][0]["token_ids"]
    assert ids, answer
    return ids


def case(c, seed: int, item_id: str | None = None) -> tuple[bytes, str, list[int]]:
    """An image, its item id (content-derived unless given) and the aggregated server's
    greedy tokens for it: the reference every EPD answer must equal."""
    image = sample_image_png(seed=seed)
    item_id = item_id or content_item_id(image, MODEL_NAME)
    return image, item_id, tokens(ask(c, c["agg"], image, item_id))


def encode(c, image, item_id) -> dict:
    params = ask(c, c["prod"], image, item_id, max_tokens=1).get("ec_transfer_params")
    assert params and item_id in params["epd"]["items"], params
    return params


def metric(c, name) -> float:
    return metric_value(c["client"].get(c["cons"].url + "/metrics").text, f"vllm:epd_{name}")


def wait_metric(c, name, at_least, timeout=15.0) -> float:
    """The metric once it reaches `at_least` (vLLM publishes stats a step or two later)."""
    wait_for(lambda: metric(c, name) >= at_least, timeout, interval=0.2)
    return metric(c, name)


def ask_before_encoding(c, image, item_id, wait_s: float = 2.0) -> dict:
    """Send the consumer a request that names the item (ids only) before the producer has
    made it, check it is still waiting after `wait_s`, then encode; the consumer's answer."""
    result: dict = {}
    promised = {"epd": {"items": [item_id]}}
    t = threading.Thread(target=lambda: result.update(ask(c, c["cons"], image, item_id, promised)))
    t.start()
    time.sleep(wait_s)
    assert t.is_alive(), "consumer answered before the item existed"
    encode(c, image, item_id)
    t.join(timeout=60)
    assert not t.is_alive()
    return result
