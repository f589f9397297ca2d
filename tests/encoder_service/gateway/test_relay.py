"""The relay (relay.py) over real HTTP, a real gateway in front of stub upstreams
(stubs.py): a streamed answer is passed through chunk by chunk, and the token ids the gateway
asks for (failover needs them) reach only a client that asked. (Failover itself:
test_failover.py and the e2e tests.)"""

from __future__ import annotations

import json

import httpx

from encoder_service.local.requests import chat_body, sample_image_png
from tests.encoder_service.gateway.stubs import MODEL, Lab
from tests.helpers import port_block

LAB = Lab(port_block(__name__))


def test_streamed_answer_is_passed_through(gw, stubs):
    body = {**chat_body(MODEL, sample_image_png(13), "x"), "stream": True}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert [json.loads(line[6:])["t"] for line in text.split("\n\n")
            if line.startswith("data: {")] == ["a", "b", "c"]
    assert text.rstrip().endswith("data: [DONE]")


def test_token_ids_reach_a_streaming_client_only_when_it_asked(gw, stubs):
    """The gateway asks the decode instance for token ids (failover needs them) and removes
    them from the stream of a client that did not ask."""
    _, dec = stubs
    for asked in (False, True):
        body = {**chat_body(MODEL, sample_image_png(14), "x"), "stream": True}
        if not asked:
            del body["return_token_ids"]
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                          timeout=10) as r:
            text = r.read().decode()
        assert dec.calls[-1]["return_token_ids"] is True
        events = [json.loads(line[6:]) for line in text.split("\n\n")
                  if line.startswith("data: {")]
        assert [e["t"] for e in events] == ["a", "b", "c"]
        assert ("prompt_token_ids" in events[0]) is asked
        assert all(("token_ids" in e["choices"][0]) is asked for e in events)


def test_a_stream_broken_after_its_last_token_ends_cleanly_unless_usage_is_missing(gw, stubs):
    """Only `data: [DONE]` was lost: the gateway sends it (the client got the whole answer).
    A usage chunk the client asked for cannot be made up: that stream ends with an error."""
    _, dec = stubs
    dec.break_at_end = True
    try:
        for usage in (False, True):
            body = {**chat_body(MODEL, sample_image_png(15), "x"), "stream": True}
            if usage:
                body["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                              timeout=10) as r:
                text = r.read().decode()
            events = [e for e in text.split("\n\n") if e]
            assert [json.loads(e[6:])["t"] for e in events if '"t"' in e] == ["a", "b", "c"]
            if usage:
                assert "decode_broke" in events[-1]
            else:
                assert events[-1] == "data: [DONE]" and "error" not in text
    finally:
        dec.break_at_end = False
