"""Mid-stream failover logic: what the client was sent, where a continuation may start (the
clean cut), which requests continue how (the field policy), the repeated part checked and
dropped. The e2e tests break real decode streams and compare with the aggregated server."""

from __future__ import annotations

import json

import pytest

from encoder_service.gateway.upstreams.failover import (
    Cut,
    GenerateToChat,
    ResumeMismatch,
    StreamTracker,
    generate_request,
    plan,
    skip_for,
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


def test_what_cannot_be_continued_is_not():
    done = StreamTracker(False)
    done.feed(chunk("a", [1], finish="stop"))
    tools = StreamTracker(False)
    tools.feed(sse({"choices": [{"delta": {"tool_calls": [{"id": "t"}]}, "token_ids": [1]}]}))
    two = StreamTracker(False)
    two.feed(sse({"choices": [{"delta": {"content": "a"}, "token_ids": [1]},
                              {"delta": {"content": "b"}, "token_ids": [2]}]}))
    greedy = {**BODY, "temperature": 0}
    for t in (done, tools, two):
        assert plan(greedy, {"temperature": 0.0, "max_tokens": 10}, t)[0] is None


def test_the_tail_a_finished_answer_lacks_is_done_unless_usage_is_due():
    t = StreamTracker(False)
    t.feed(ROLE + chunk("a", [1]))
    assert t.tail() is None  # not finished: a continuation is needed
    t.feed(chunk("b", [2], finish="stop"))
    assert t.tail() == b"data: [DONE]\n\n"
    t.feed(b"data: [DONE]\n\n")
    assert t.tail() == b""  # nothing is missing
    usage = StreamTracker(False, wants_usage=True)
    usage.feed(ROLE + chunk("a", [1], finish="length"))
    assert usage.tail() is None  # the usage chunk only the server can count
    usage.feed(sse({"id": "chatcmpl-a", "choices": [], "usage": {"total_tokens": 4}}))
    assert usage.tail() == b"data: [DONE]\n\n"


def tracked(*chunks: bytes) -> StreamTracker:
    t = StreamTracker(False)
    t.feed(ROLE + b"".join(chunks))
    return t


PARAMS = {"temperature": 0.0, "max_tokens": 10}


def test_the_clean_cut_is_after_the_last_one_token_chunk_with_text():
    # "é" split over two byte tokens: the first decodes to no text yet (held back)
    t = tracked(chunk("Hel", [7]), chunk("lo", [8, 9]), chunk("", [10]))
    assert t.token_ids == [7, 8, 9, 10] and t.clean == Cut(1, 3)
    t.feed(chunk("é", [11]))
    assert t.clean == Cut(5, 6)


@pytest.mark.parametrize("extra, params, how", [
    ({"temperature": 0}, PARAMS, "token_in"),
    ({}, PARAMS, "token_in"),  # the model's default, as rendered, is greedy
    ({"temperature": 0, "ignore_eos": True, "min_tokens": 4, "stop_token_ids": [5],
      "logit_bias": {"3": -5}, "repetition_penalty": 1.3}, PARAMS, "token_in"),
    ({"temperature": 0, "presence_penalty": 0.5}, PARAMS, "replay"),
    ({"temperature": 0, "frequency_penalty": 0.5}, PARAMS, "replay"),
    ({"temperature": 0, "stop": ["lo w"]}, PARAMS, "replay"),
    ({"temperature": 0, "response_format": {"type": "json_object"}}, PARAMS, "replay"),
    ({"temperature": 0, "stream_options": {"include_usage": True}}, PARAMS, "replay"),
    ({"temperature": 0}, None, "replay"),  # no token-in API on the other instances
    ({"temperature": 0.8, "seed": 3}, {"temperature": 0.8, "max_tokens": 10}, "replay"),
    ({"temperature": 0.8}, {"temperature": 0.8, "max_tokens": 10}, None),  # cut not at the end
    ({"temperature": 0.8, "presence_penalty": 1}, {"temperature": 0.8, "max_tokens": 10}, None),
    ({}, None, None),  # unknown temperature, no seed
])
def test_each_field_continues_token_in_or_by_replay_or_not_at_all(extra, params, how):
    t = tracked(chunk("Hel", [7]), chunk("", [8]))  # ends inside a character
    got, cut = plan({**BODY, **extra}, params, t)
    assert got == how
    if how == "token_in":
        assert cut == Cut(1, 3)
    elif how == "replay":
        assert cut == Cut(0, 0)


def test_unseeded_sampling_continues_only_exactly_where_the_client_is_seeded_replays():
    sampling = {**BODY, "temperature": 0.7}
    at_end = tracked(chunk("Hel", [7]), chunk("lo", [8]))
    assert plan(sampling, {"temperature": 0.7, "max_tokens": 10}, at_end) == (
        "token_in", Cut(2, 5))
    seeded = {**sampling, "seed": 1}  # the generator's draws count from the first token
    assert plan(seeded, {"temperature": 0.7, "max_tokens": 10}, at_end) == ("replay", Cut(0, 0))
    nothing_seen = tracked()
    assert plan(sampling, None, nothing_seen) == ("replay", Cut(0, 0))


def test_the_repeated_part_is_checked_and_dropped_ids_and_text():
    t = tracked(chunk("Hel", [7]), chunk("lo", [8, 9]), chunk("", [10]))
    t.resume(skip_for(t, Cut(1, 3)))  # from the clean cut: [8, 9, 10] and "lo" again
    out = t.feed(chunk("l", [8]) + chunk("o", [9]) + chunk("é!", [10, 11]) + chunk("?", [12]))
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e]
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["é!", "?"]
    assert t.token_ids == [7, 8, 9, 10, 11, 12] and t.sent_text == "Hello\u00e9!?"
    wrong = tracked(chunk("Hel", [7]), chunk("lo", [8]))
    wrong.resume(skip_for(wrong, Cut(1, 3)))
    with pytest.raises(ResumeMismatch):
        wrong.feed(chunk("lp", [8]))  # the right token, other text
    short = tracked(chunk("Hel", [7]), chunk("lo", [8]))
    short.resume(skip_for(short, Cut(0, 0)))
    with pytest.raises(ResumeMismatch):
        short.feed(chunk("Hel", [7], finish="stop"))  # ended before the client's point


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
    assert upstream_body(BODY)["return_token_ids"] is True and "return_token_ids" not in BODY
    t = StreamTracker(False)
    t.feed(ROLE + chunk("Hel", [7]) + chunk("lo", [8]))
    rendered = {"request_id": "r", "token_ids": [1, 2, 3], "features": {"x": 1},
                "sampling_params": {"max_tokens": 10, "temperature": 0.0}}
    sent = {**BODY, "ec_transfer_params": {"epd": {"items": {}}}}
    req = generate_request(rendered, sent, t, Cut(2, 5))
    assert req["token_ids"] == [1, 2, 3, 7, 8] and req["features"] == {"x": 1}
    assert req["sampling_params"]["max_tokens"] == 8 and req["stream"] is True
    assert req["output_mode"] == "text" and req["ec_transfer_params"] == sent[
        "ec_transfer_params"]
    assert rendered["token_ids"] == [1, 2, 3]  # not changed in place
    # another prompt (a template rendering differently): not continued this way
    assert generate_request({**rendered, "token_ids": [1, 2, 4]}, sent, t, Cut(2, 5)) is None
    assert generate_request([rendered], sent, t, Cut(2, 5)) is not None  # vLLM may answer a list
    # render leaves out a max_tokens equal to vLLM's default (16): the client's limit holds
    omitted = {**rendered, "sampling_params": {"temperature": 0.0}}
    assert generate_request(omitted, {**sent, "max_tokens": 16}, t, Cut(2, 5))[
        "sampling_params"]["max_tokens"] == 14
    assert generate_request(omitted, {**sent, "max_completion_tokens": 16}, t, Cut(2, 5))[
        "sampling_params"]["max_tokens"] == 14
    # from an earlier cut the tokens after it are generated again: counted from the cut
    again = generate_request(rendered, sent, t, Cut(1, 3))
    assert again["token_ids"] == [1, 2, 3, 7] and again["sampling_params"]["max_tokens"] == 9
    assert generate_request(rendered, {**sent, "max_tokens": 2}, t, Cut(2, 5)) is None
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
