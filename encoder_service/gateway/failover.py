"""Mid-stream failover of a streamed chat answer: when the decode instance dies after the
first token, another instance continues the same answer and the client sees one stream.

How: the gateway asks the decode instance for token ids (vLLM's `return_token_ids`) and
follows the stream event by event (`StreamTracker`): the prompt's token ids, and the text and
token ids the client has been sent. On a break, another instance continues token for token
through vLLM's token-in API when it serves it (`--enable-scale-out`, which `epd up` gives
decode instances): `/v1/chat/completions/render` of the same chat request must give exactly
the first prompt, then `/inference/v1/generate` runs on that prompt plus the tokens sent, and
its text stream is turned back into chat chunks (`GenerateToChat`). Otherwise it asks for the
begun assistant message to be continued (`continue_final_message`, the text so far,
`max_tokens` less what was sent) and checks that the prompt that instance built is exactly
the first prompt followed by the tokens already sent. Either way greedy decoding then
continues as the lost instance would have, with no token repeated or missing. When neither
path can prove that (the chat template or the tokenizer renders the begun message differently,
no token-in API), or the request cannot be continued (several choices, tool calls, logprobs),
the stream ends with an error event, as without failover: never a wrong token. A
non-streamed answer that breaks off is simply asked again elsewhere (the client has seen
nothing). Token ids the client did not ask for are removed from what it gets.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode


class StreamTracker:
    """Follows a chat completion stream (SSE bytes in, SSE bytes out): what was sent.
    `resume()` switches it to a continuation's stream: its role chunk is dropped (the client
    had one) and its chunks carry the first stream's id."""

    def __init__(self, client_wants_ids: bool) -> None:
        self.client_wants_ids = client_wants_ids
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.finished = False  # a finish_reason or [DONE] passed
        self.continuable = True  # one plain-text choice so far
        self.stream_id: str | None = None
        self.prompt_ids: list[int] | None = None  # the first stream's prompt
        self._resumed = False
        self._pending = b""

    def resume(self) -> None:
        self._resumed = True
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """The part of `chunk` to send on (whole events only; a partial one waits)."""
        data = self._pending + chunk
        *events, self._pending = data.split(b"\n\n")
        out = [self._event(e) for e in events]
        return b"".join(e + b"\n\n" for e in out if e)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: "):
            return event
        if event.startswith(b"data: [DONE]"):
            self.finished = True
            return event
        try:
            body = _decode(event[6:])
        except msgspec.DecodeError:
            self.continuable = False
            return event
        if not isinstance(body, dict):
            return event
        changed = False
        choices = body.get("choices") or []
        if len(choices) > 1:
            self.continuable = False
        role_only = bool(choices)
        for choice in choices:
            delta = choice.get("delta") or {}
            if set(delta) - {"role", "content"} or choice.get("logprobs"):
                self.continuable = False  # tool calls, reasoning, logprobs: not continued
            if delta.get("content"):
                self.text.append(delta["content"])
            self.token_ids.extend(choice.get("token_ids") or ())
            if choice.get("finish_reason"):
                self.finished = True
            if (delta.get("content") or choice.get("token_ids") or choice.get("finish_reason")
                    or "role" not in delta):
                role_only = False
            if not self.client_wants_ids and choice.pop("token_ids", None) is not None:
                changed = True
        prompt = body.get("prompt_token_ids")
        if prompt is not None and self.prompt_ids is None and not self._resumed:
            self.prompt_ids = list(prompt)
        if not self.client_wants_ids and body.pop("prompt_token_ids", None) is not None:
            changed = True
        if self._resumed:
            if role_only:
                return b""  # the continuation's role chunk: the client has one
            if self.stream_id and body.get("id") != self.stream_id:
                body["id"], changed = self.stream_id, True
        elif self.stream_id is None and isinstance(body.get("id"), str):
            self.stream_id = body["id"]
        return b"data: " + _encode(body) if changed else event


def upstream_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body to send upstream for a streamed chat request: token ids on (the tracker
    removes them again from what a client that did not ask gets)."""
    return body if body.get("return_token_ids") is True else {**body, "return_token_ids": True}


def continuation(body: dict[str, Any], sent: StreamTracker) -> dict[str, Any] | None:
    """The request that continues the answer `sent` began (None: it cannot be continued)."""
    if (not sent.continuable or sent.finished or not sent.token_ids or sent.prompt_ids is None
            or body.get("n", 1) != 1):
        return None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    cont = copy.copy(body)
    cont["messages"] = [*messages, {"role": "assistant", "content": "".join(sent.text)}]
    cont["continue_final_message"] = True
    cont["add_generation_prompt"] = False
    cont["return_token_ids"] = True
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int):
            left = body[key] - len(sent.token_ids)
            if left <= 0:
                return None
            cont[key] = left
    if isinstance(body.get("min_tokens"), int):
        cont["min_tokens"] = max(0, body["min_tokens"] - len(sent.token_ids))
    return cont


def exact_resume(first_events: bytes, sent: StreamTracker) -> bool:
    """Is the continuation's prompt exactly the first prompt followed by the tokens already
    sent? (vLLM puts `prompt_token_ids` in the first chunk when asked for token ids.) Chat
    templates and tokenizers may render the begun assistant message differently (a merge
    across the boundary, a separator): then greedy decoding could go another way, so no."""
    for event in first_events.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        try:
            body = _decode(event[6:])
        except msgspec.DecodeError:
            return False
        prompt = body.get("prompt_token_ids") if isinstance(body, dict) else None
        if prompt is not None:
            return sent.prompt_ids is not None and prompt == sent.prompt_ids + sent.token_ids
    return False


def generate_request(rendered: Any, sent_body: dict[str, Any], sent: StreamTracker
                     ) -> dict[str, Any] | None:
    """vLLM's token-in request (`POST /inference/v1/generate`) that continues the answer:
    the prompt `/v1/chat/completions/render` made from the same chat request, which must be
    exactly the first prompt, then the tokens already sent; text out, streamed. None when the
    prompt differs or nothing is left to generate."""
    if isinstance(rendered, list) and len(rendered) == 1:
        rendered = rendered[0]
    if (not isinstance(rendered, dict) or sent.prompt_ids is None or not sent.token_ids
            or rendered.get("token_ids") != sent.prompt_ids):
        return None
    req = dict(rendered)
    req["token_ids"] = sent.prompt_ids + sent.token_ids
    params = dict(req.get("sampling_params") or {})
    # vLLM's render leaves out fields equal to SamplingParams' defaults: a client's
    # max_tokens of exactly 16 would be lost, and /generate would then run to the model's
    # length. The client's own limit is the one to keep.
    asked = sent_body.get("max_completion_tokens", sent_body.get("max_tokens"))
    if isinstance(asked, int) and not isinstance(asked, bool):
        params["max_tokens"] = asked
    if isinstance(params.get("max_tokens"), int):
        params["max_tokens"] -= len(sent.token_ids)
        if params["max_tokens"] <= 0:
            return None
    if isinstance(params.get("min_tokens"), int):
        params["min_tokens"] = max(0, params["min_tokens"] - len(sent.token_ids))
    params["detokenize"] = True
    req.update(sampling_params=params, stream=True, output_mode="text")
    if sent_body.get("ec_transfer_params") is not None:  # metadata-only items load from EPD
        req["ec_transfer_params"] = sent_body["ec_transfer_params"]
    return req


class GenerateToChat:
    """Turns vLLM's token-in stream (`{"choices": [{"text", "token_ids", "finish_reason"}]}`)
    into chat completion chunks of the stream it continues (same id and model)."""

    def __init__(self, stream_id: str | None, model: str) -> None:
        self.stream_id, self.model = stream_id or "chatcmpl-resumed", model
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        *events, self._pending = data.split(b"\n\n")
        return b"".join(self._event(e) for e in events)

    def _event(self, event: bytes) -> bytes:
        if event.startswith(b"data: [DONE]"):
            return event + b"\n\n"
        if not event.startswith(b"data: "):
            return b""
        try:
            body = _decode(event[6:])
        except msgspec.DecodeError:
            return b""
        if not isinstance(body, dict):
            return b""
        if "error" in body:
            return event + b"\n\n"
        choices = [{"index": c.get("index", 0), "delta": {"content": c.get("text") or ""},
                    "token_ids": c.get("token_ids") or [],
                    "finish_reason": c.get("finish_reason")}
                   for c in body.get("choices") or () if isinstance(c, dict)]
        if not choices:
            return b""
        return b"data: " + _encode({"id": self.stream_id, "object": "chat.completion.chunk",
                                     "model": self.model, "choices": choices}) + b"\n\n"
