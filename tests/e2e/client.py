"""Client helpers of the end-to-end tests: one request to a real server (an image for the
tiny LLaVA, media parts for the Qwen models), its greedy tokens, the reference answer of the
aggregated server, metrics. `c` is a cluster dict of a module fixture (client, and agg, prod,
cons: VllmServer) or, for the helpers that need no server of it, an httpx.Client; `server` a
server (its `url`) or a URL."""

from __future__ import annotations

import copy
import json
import threading
import time

import httpx

from ec_connectors.protocol.keys import content_item_id
from encoder_service.local.processes import metric_value
from encoder_service.local.requests import chat_body, data_url, parts_body, sample_image_png
from tests.helpers import wait_for

MODEL_NAME = "tiny-llava"
PROMPT = "what is in this picture"
PARTS_PROMPT = "describe this"  # the Qwen models' requests (media parts)

# sampling fields of a request, each with how the gateway continues its stream when it is cut
# mid-answer (test_gateway; tests/prewarm.py compiles their kernels ahead)
FIELDS = [
    ({"ignore_eos": True, "max_tokens": 60}, "token-in from a clean cut"),
    ({"ignore_eos": True, "max_tokens": 40, "min_tokens": 30, "stop_token_ids": [5],
      "logit_bias": {"40": 3}, "repetition_penalty": 1.3}, "token-in"),
    ({"max_tokens": 40, "presence_penalty": 0.7, "frequency_penalty": 0.4}, "replay"),
    ({"max_tokens": 40, "ignore_eos": True, "stop": ["ot", "e "]}, "replay"),
    ({"max_tokens": 40, "temperature": 0.9, "seed": 11, "top_p": 0.9}, "replay"),
    ({"max_tokens": 30, "ignore_eos": True, "stream_options": {"include_usage": True}},
     "replay"),
    ({"max_tokens": 30, "logprobs": True, "top_logprobs": 2}, "refused"),
]


def _http(c) -> httpx.Client:
    return c if isinstance(c, httpx.Client) else c["client"]


def url_of(server) -> str:
    return server if isinstance(server, str) else server.url


def ask(c, server, image, item_id=None, params=None, max_tokens=8, mime=None, **extra) -> dict:
    """One greedy chat request for `image` (sent as `mime` when given, else PNG) naming
    `item_id` and carrying `params` when given, `extra` more body fields; the answer (200)."""
    body = chat_body(MODEL_NAME, image, PROMPT, item_id=item_id, max_tokens=max_tokens,
                     ec_transfer_params=params)
    if mime:
        body["messages"][0]["content"][0]["image_url"]["url"] = data_url(image, mime)
    r = _http(c).post(url_of(server) + "/v1/chat/completions", json={**body, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def tokens(reply: dict) -> list[int]:
    ids = reply["choices"][0]["token_ids"]
    assert ids, reply
    return ids


def answer(c, server, image, **kw) -> list[int]:
    """The greedy tokens `server` answers for `image` (`ask`'s keywords)."""
    return tokens(ask(c, server, image, **kw))


def post_parts(c, server, parts, model, prompt=PARTS_PROMPT, **extra) -> httpx.Response:
    """A greedy chat request with media `parts` (copied: the body may change them) then
    `prompt`; the response, whatever its status."""
    return _http(c).post(url_of(server) + "/v1/chat/completions",
                         json=parts_body(model, copy.deepcopy(parts), prompt, **extra))


def ask_parts(c, server, parts, model, prompt=PARTS_PROMPT, **extra) -> dict:
    """`post_parts`, answered (200)."""
    r = post_parts(c, server, parts, model, prompt, **extra)
    assert r.status_code == 200, r.text
    return r.json()


def answer_parts(c, server, parts, model, prompt=PARTS_PROMPT, **extra) -> list[int]:
    """The greedy tokens of `ask_parts`."""
    return tokens(ask_parts(c, server, parts, model, prompt, **extra))


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


def metric_at(c, server, name) -> float:
    """Metric `name` of `server`'s /metrics (its samples of every label set summed)."""
    return metric_value(_http(c).get(url_of(server) + "/metrics").text, name)


def metric(c, name, server=None) -> float:
    """Connector metric vllm:epd_<name> of the consumer (or of `server`)."""
    return metric_at(c, c["cons"] if server is None else server, f"vllm:epd_{name}")


def wait_metric(c, name, at_least, timeout=15.0, server=None) -> float:
    """`metric` once it reaches `at_least` (vLLM publishes stats a step or two later)."""
    wait_for(lambda: metric(c, name, server) >= at_least, timeout, interval=0.2)
    return metric(c, name, server)


def encoder_calls(c, server) -> float:
    """Requests a vLLM server finished (vllm:request_success_total): an encoder's encodes."""
    return metric_at(c, server, "vllm:request_success_total")


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


def stream_killing(client: httpx.Client, url: str, body: dict, kill) -> tuple[list[int],
                                                                            list[dict], bool]:
    """Stream `body` from `url` + /v1/chat/completions, calling `kill()` once after the
    first tokens: (the token ids received, the error events, whether it killed)."""
    got: list[int] = []
    errors: list[dict] = []
    killed = False
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event)
                continue
            got += event["choices"][0].get("token_ids") or [] if event["choices"] else []
            if got and not killed:
                kill()  # mid-stream
                killed = True
    return got, errors, killed
