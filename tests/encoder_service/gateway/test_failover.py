"""Mid-stream failover logic: what the client was sent, the continuation request, the
exactness check (the e2e test kills a real decode instance mid-stream)."""

from __future__ import annotations

import json

from encoder_service.gateway.failover import (
    StreamTracker,
    continuation,
    exact_resume,
    upstream_body,
)


def sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def chunk(content: str, ids: list[int], cid: str = "chatcmpl-a", finish=None) -> bytes:
    return sse({"id": cid, "choices": [{"index": 0, "delta": {"content": content},
                                        "token_ids": ids, "finish_reason": finish}]})


ROLE = sse({"id": "chatcmpl-a", "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
BODY = {"model": "m", "stream": True, "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}]}


def test_the_tracker_records_what_was_sent_and_hides_ids_the_client_did_not_ask_for():
    t = StreamTracker(client_wants_ids=False)
    raw = ROLE + chunk("Hel", [7]) + chunk("lo", [8])
    out = t.feed(raw[:25]) + t.feed(raw[25:])  # split inside an event: whole events only
    assert t.text == ["Hel", "lo"] and t.token_ids == [7, 8] and not t.finished
    assert b"token_ids" not in out and b"prompt_token_ids" not in out
    assert out.count(b"\n\n") == 3 and b'"Hel"' in out
    kept = StreamTracker(client_wants_ids=True)
    assert kept.feed(ROLE + chunk("x", [9])) == ROLE + chunk("x", [9])  # untouched bytes


def test_a_continuation_asks_for_the_rest_of_the_same_assistant_message():
    body = upstream_body(BODY)
    assert body["return_token_ids"] is True and "return_token_ids" not in BODY
    t = StreamTracker(False)
    t.feed(ROLE + chunk("Hel", [7]) + chunk("lo", [8]))
    cont = continuation(body, t)
    assert cont["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert cont["continue_final_message"] and not cont["add_generation_prompt"]
    assert cont["max_tokens"] == 8 and BODY["max_tokens"] == 10
    # exact only when the new prompt ends with the tokens already sent
    assert t.prompt_ids == [1, 2, 3]
    assert exact_resume(sse({"prompt_token_ids": [1, 2, 3, 7, 8], "choices": []}), t)
    assert not exact_resume(sse({"prompt_token_ids": [1, 2, 3, 78], "choices": []}), t)
    # the sent tokens at the end but the prompt rendered differently before them: no
    assert not exact_resume(sse({"prompt_token_ids": [1, 2, 9, 3, 7, 8], "choices": []}), t)
    assert not exact_resume(b"data: not json\n\n", t)


def test_what_cannot_be_continued_is_not():
    done = StreamTracker(False)
    done.feed(chunk("a", [1], finish="stop"))
    tools = StreamTracker(False)
    tools.feed(sse({"choices": [{"delta": {"tool_calls": [{"id": "t"}]}, "token_ids": [1]}]}))
    two = StreamTracker(False)
    two.feed(sse({"choices": [{"delta": {"content": "a"}, "token_ids": [1]},
                              {"delta": {"content": "b"}, "token_ids": [2]}]}))
    nothing = StreamTracker(False)
    nothing.feed(ROLE)
    for t in (done, tools, two, nothing):
        assert continuation(BODY, t) is None
    spent = StreamTracker(False)
    spent.feed(ROLE + chunk("a" * 10, list(range(10))))
    assert continuation(BODY, spent) is None  # max_tokens reached


def test_a_resumed_stream_drops_its_role_chunk_and_keeps_the_first_id():
    t = StreamTracker(False)
    t.feed(ROLE + chunk("Hel", [7]))
    t.resume()
    out = t.feed(sse({"id": "chatcmpl-b", "prompt_token_ids": [1, 2, 3, 7],
                      "choices": [{"delta": {"role": "assistant", "content": ""}}]})
                 + chunk("lo", [8], cid="chatcmpl-b") + chunk("", [9], cid="chatcmpl-b")
                 + b"data: [DONE]\n\n")
    events = [e for e in out.split(b"\n\n") if e]
    # a token that decodes to no text yet (part of a character) is still passed on
    assert len(events) == 3 and json.loads(events[0][6:])["id"] == "chatcmpl-a"
    assert t.text == ["Hel", "lo"] and t.token_ids == [7, 8, 9] and t.finished


def test_the_token_in_continuation_starts_from_the_same_prompt_and_the_tokens_sent():
    from encoder_service.gateway.failover import GenerateToChat, generate_request

    t = StreamTracker(False)
    t.feed(ROLE + chunk("Hel", [7]) + chunk("lo", [8]))
    rendered = {"request_id": "r", "token_ids": [1, 2, 3], "features": {"x": 1},
                "sampling_params": {"max_tokens": 10, "temperature": 0.0}}
    sent = {**BODY, "ec_transfer_params": {"epd": {"items": {}}}}
    req = generate_request(rendered, sent, t)
    assert req["token_ids"] == [1, 2, 3, 7, 8] and req["features"] == {"x": 1}
    assert req["sampling_params"]["max_tokens"] == 8 and req["stream"] is True
    assert req["output_mode"] == "text" and req["ec_transfer_params"] == sent[
        "ec_transfer_params"]
    assert rendered["token_ids"] == [1, 2, 3]  # not changed in place
    # another prompt (a template rendering differently): not continued this way
    assert generate_request({**rendered, "token_ids": [1, 2, 4]}, sent, t) is None
    assert generate_request([rendered], sent, t) is not None  # vLLM may answer a list
    # render leaves out a max_tokens equal to vLLM's default (16): the client's limit holds
    omitted = {**rendered, "sampling_params": {"temperature": 0.0}}
    assert generate_request(omitted, {**sent, "max_tokens": 16}, t)["sampling_params"][
        "max_tokens"] == 14
    assert generate_request(omitted, {**sent, "max_completion_tokens": 16}, t)[
        "sampling_params"]["max_tokens"] == 14
    out = GenerateToChat("chatcmpl-a", "m").feed(
        b'data: {"request_id": "g", "choices": [{"index": 0, "text": "!", "token_ids": [9],'
        b' "finish_reason": null}]}\n\ndata: {"choi' )
    event = json.loads(out.split(b"\n\n")[0][6:])
    assert event["id"] == "chatcmpl-a" and event["object"] == "chat.completion.chunk"
    assert event["choices"][0]["delta"] == {"content": "!"} and event["choices"][0][
        "token_ids"] == [9]
    t.resume()
    passed = t.feed(out)
    assert b"token_ids" not in passed and t.token_ids == [7, 8, 9] and t.text[-1] == "!"
