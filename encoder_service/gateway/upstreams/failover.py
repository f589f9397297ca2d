"""Mid-stream failover of a streamed chat answer: the pure half.

Mid-stream failover of a streamed chat answer, the pure half: when the decode instance dies
after the first token, another instance continues the same answer and the client sees one
stream, token for token and character for character what it would have seen without the
failure, or an error event after a correct prefix. Never a wrong token. (The I/O half, which
opens the continuation on another instance, is `resume.py`.)

The gateway asks the decode instance for token ids (vLLM's `return_token_ids`) and follows
the stream event by event (`StreamTracker`): the prompt's ids, and the text and ids the client
has been sent. On a break a continuation is opened on another instance from a *cut*: a point
of the answer at which the continuation is known to go on exactly as the lost instance would
have. Whatever the continuation produces again before the point the client reached is checked
against what the client got, ids and text, and dropped (`Skip`); a difference ends the stream
with an error event instead.

Two kinds of continuation (`plan`):
- **token-in** (vLLM's `/v1/chat/completions/render` + `/inference/v1/generate`, served by
  instances started with `--enable-scale-out`): the first prompt plus the tokens sent up to
  the last *clean* cut, generated on from there. A cut is clean where the stream had just
  emitted a one-token chunk with text: vLLM's detokenizer (tokenizers' `DecodeStream`) holds no
  bytes back there. At any other point (inside a multi-byte character, after skipped special
  tokens) a detokenizer primed with prompt + tokens starts with no prefix and emits the whole
  prompt as new text (how often on the tiny model: docs/benchmarks.md). Only
  for requests whose next tokens do not depend on which tokens are "output" and which
  "prompt" (`TOKEN_IN_KEYS`): greedy, or unseeded sampling cut exactly where the client is.
- **replay**: the same chat request again, from its first token, for a deterministic request
  (greedy, or a `seed`): everything that depends on the output so far (presence and frequency
  penalties, stop strings, structured outputs, the seeded generator, usage) is then the same
  as on the lost instance. It costs the tokens sent generated again.
Requests that are neither (several choices, logprobs, tool calls, unseeded sampling cut
elsewhere) are not continued: the stream ends with an error event, as without failover. A
non-streamed answer that breaks off is simply asked again elsewhere (the client has seen
nothing). Token ids the client did not ask for are removed from what it gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encoder_service.gateway.wire import DecodeError, json_decode, json_encode

# Top-level chat request keys a token-in continuation keeps exact, as long as their values
# are neutral where noted in `_token_in_refusal`: sampling is per step (temperature, top_*,
# min_p, logit_bias, allowed_token_ids), the repetition penalty counts prompt and output
# tokens alike (vLLM: prompt_mask | output_mask), min/max tokens are counted down from the
# cut, and EOS handling is the same at every step. Anything else (presence/frequency
# penalties, stop strings, bad words, structured outputs, tools, logprobs, echo, n, usage, a
# prompt truncation) depends on what counts as output, or shapes the stream: replay instead.
TOKEN_IN_KEYS = frozenset({
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logit_bias",
    "allowed_token_ids", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "return_token_ids", "ec_transfer_params", "user",
    "add_generation_prompt", "continue_final_message", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "priority", "request_id", "cache_salt",
    "logprobs", "top_logprobs", "parallel_tool_calls", "tool_choice", "n",
})


class StreamTracker:
    """Follows a chat completion stream (SSE bytes in, SSE bytes out): what was sent.

    `resume(skip)` switches it to a continuation's stream: what the continuation produces again
    is checked and dropped (`skip`), its role chunk is dropped (the client had one) and its
    chunks carry the first stream's id."""

    def __init__(self, client_wants_ids: bool, wants_usage: bool = False) -> None:
        self.client_wants_ids = client_wants_ids
        self.text: list[str] = []
        self.text_len = 0
        self.token_ids: list[int] = []
        self.finished = False  # a finish_reason or [DONE] passed
        self.done_sent = False  # [DONE] passed
        self.wants_usage = wants_usage  # a usage chunk is due after the finish
        self.usage_sent = False
        self.continuable = True  # one plain-text choice so far
        self.stream_id: str | None = None
        self.prompt_ids: list[int] | None = None  # the first stream's prompt
        self.clean = Cut(0, 0)  # the last clean cut (see the module docstring)
        self._skip: Skip | None = None
        self._resumed = False
        self._pending = b""

    def resume(self, skip: Skip | None = None) -> None:
        self._resumed = True
        self._skip = skip
        self._pending = b""

    def tail(self) -> bytes | None:
        """What still ends the stream for the client after a late break.

        What ends the stream for the client when it broke after the answer finished:
        `data: [DONE]` (b"" when that passed too); None when something else is missing (the
        answer, or a usage chunk only the model's server can count)."""
        if self.done_sent:
            return b""
        if self.finished and self.continuable and (self.usage_sent or not self.wants_usage):
            return b"data: [DONE]\n\n"
        return None

    @property
    def sent_text(self) -> str:
        return "".join(self.text)

    def feed(self, chunk: bytes) -> bytes:
        """The part of `chunk` to send on (whole events only; a partial one waits).

        Raises `ResumeMismatch` when a continuation's repeated part differs from what was sent."""
        data = self._pending + chunk
        *events, self._pending = data.split(b"\n\n")
        out = [self._event(e) for e in events]
        return b"".join(e + b"\n\n" for e in out if e)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: "):
            return event
        if event.startswith(b"data: [DONE]"):
            if self._skip is not None and not self._skip.done:
                raise ResumeMismatch("the continuation ended before the point the client saw")
            self.finished = self.done_sent = True
            return event
        try:
            body = json_decode(event[6:])
        except DecodeError:
            self.continuable = False
            return event
        if not isinstance(body, dict):
            return event
        if body.get("usage") is not None:
            self.usage_sent = True
        changed = False
        choices = body.get("choices") or []
        if len(choices) > 1:
            self.continuable = False
        if self._skip is not None and choices and not self._skip.done:
            if not self._skip.take(choices[0]):
                return b""  # all of it was sent before
            changed = True
        role_only, stripped = self._choices(choices)
        changed = self._prompt(body) or stripped or changed
        if self._resumed:
            if role_only:
                return b""  # the continuation's role chunk: the client has one
            if self.stream_id and body.get("id") != self.stream_id:
                body["id"], changed = self.stream_id, True
        elif self.stream_id is None and isinstance(body.get("id"), str):
            self.stream_id = body["id"]
        return b"data: " + json_encode(body) if changed else event

    def _choices(self, choices: list[Any]) -> tuple[bool, bool]:
        """Follow one event's choices: (a role-only chunk?, token ids removed?)."""
        role_only, stripped = bool(choices), False
        for choice in choices:
            delta = choice.get("delta") or {}
            if set(delta) - {"role", "content"} or choice.get("logprobs"):
                self.continuable = False  # tool calls, reasoning, logprobs: not continued
            ids = choice.get("token_ids") or ()
            content = delta.get("content")
            if content:
                self.text.append(content)
                self.text_len += len(content)
            self.token_ids.extend(ids)
            if len(ids) == 1 and content:  # the detokenizer holds nothing back here
                self.clean = Cut(len(self.token_ids), self.text_len)
            if choice.get("finish_reason"):
                self.finished = True
            if content or ids or choice.get("finish_reason") or "role" not in delta:
                role_only = False
            if not self.client_wants_ids and choice.pop("token_ids", None) is not None:
                stripped = True
        return role_only, stripped

    def _prompt(self, body: dict[str, Any]) -> bool:
        """Keep the first stream's prompt ids; True when they were removed from `body`."""
        prompt = body.get("prompt_token_ids")
        if prompt is not None and self.prompt_ids is None and not self._resumed:
            self.prompt_ids = list(prompt)
        return not self.client_wants_ids and body.pop("prompt_token_ids", None) is not None


@dataclass(frozen=True)
class Cut:
    """A point of the answer: `ids` tokens and `chars` characters of text sent."""

    ids: int
    chars: int


class ResumeMismatch(Exception):
    """A continuation produced again something other than what the client was sent."""


class Skip:
    """What a continuation must repeat exactly before it reaches new output.

    What a continuation produces again before the point the client reached: the token ids
    and text it must repeat exactly, dropped from what the client gets."""

    def __init__(self, ids: list[int], text: str) -> None:
        self.ids, self.text = ids, text
        self._i = self._t = 0

    @property
    def done(self) -> bool:
        return self._i == len(self.ids) and self._t == len(self.text)

    def take(self, choice: dict[str, Any]) -> bool:
        """Drop the checked repeated part of a choice; whether anything is new.

        Drops the repeated part of `choice` in place (after checking it); True when
        something of it is new."""
        ids = list(choice.get("token_ids") or ())
        n = min(len(ids), len(self.ids) - self._i)
        if ids[:n] != self.ids[self._i:self._i + n]:
            raise ResumeMismatch("the continuation repeated other tokens than those sent")
        self._i += n
        delta = choice.get("delta") or {}
        content = delta.get("content") or ""
        m = min(len(content), len(self.text) - self._t)
        if content[:m] != self.text[self._t:self._t + m]:
            raise ResumeMismatch("the continuation repeated other text than was sent")
        self._t += m
        if choice.get("finish_reason") and not self.done:
            raise ResumeMismatch("the continuation ended before the point the client saw")
        if n == len(ids) and m == len(content) and not choice.get("finish_reason"):
            return False
        if "token_ids" in choice:
            choice["token_ids"] = ids[n:]
        if content:
            delta["content"] = content[m:]
        return True


def upstream_body(body: dict[str, Any]) -> dict[str, Any]:
    """The upstream body of a streamed chat request, with token ids on.

    The body to send upstream for a streamed chat request: token ids on (the tracker
    removes them again from what a client that did not ask gets)."""
    return body if body.get("return_token_ids") is True else {**body, "return_token_ids": True}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token_in_refusal(body: dict[str, Any], params: dict[str, Any]) -> str | None:
    """Why the token-in continuation cannot continue `body` exactly (None: it can)."""
    extra = set(body) - TOKEN_IN_KEYS
    if extra:
        return f"fields {sorted(extra)}"
    if any(body.get(k) for k in ("presence_penalty", "frequency_penalty")):
        return "presence/frequency penalties count output tokens"
    if body.get("stop"):
        return "stop strings may span the cut"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("n", 1) != 1:
        return "logprobs or several choices"
    if body.get("tool_choice") not in (None, "none"):
        return "tools"
    if (body.get("stream_options") or {}).get("include_usage"):
        return "usage counts the whole answer"
    if not _is_int(params.get("max_tokens", 0)):
        return "no max_tokens in the rendered parameters"
    return None


def greedy(body: dict[str, Any], params: dict[str, Any] | None) -> bool:
    """Does the request decode greedily?

    (vLLM's render reports the effective temperature, the model's default included; without it
    only an explicit 0 counts.)"""
    t = (params or {}).get("temperature", body.get("temperature"))
    return isinstance(t, (int, float)) and not isinstance(t, bool) and t == 0


def plan(body: dict[str, Any], params: dict[str, Any] | None, sent: StreamTracker
         ) -> tuple[str, Cut] | tuple[None, str]:
    """Decide how to continue a broken answer, or why it cannot be.

    How to continue `body` after `sent` broke off: ("token_in", cut), ("replay", Cut(0, 0))
    or (None, why not). `params`: the sampling parameters another instance rendered for
    the same request (None: no token-in API there)."""
    if not sent.continuable or body.get("n", 1) != 1:
        return None, "several choices, tool calls or logprobs"
    if sent.finished:
        return None, "the answer had finished"
    if not sent.token_ids:
        return "replay", Cut(0, 0)  # the client saw no token yet: any answer is the answer
    if sent.prompt_ids is None:
        return None, "no prompt token ids were streamed"
    is_greedy, seeded = greedy(body, params), _is_int(body.get("seed"))
    why = "no token-in API" if params is None else _token_in_refusal(body, params)
    if why is None and (is_greedy or (not seeded and sent.clean.ids == len(sent.token_ids))):
        return "token_in", sent.clean  # unseeded sampling: only exactly where the client is
    if is_greedy or seeded:  # a seeded generator is exact only from the first token
        return "replay", Cut(0, 0)
    return None, f"sampling without a seed ({why or 'cut inside a character'})"


def skip_for(sent: StreamTracker, cut: Cut) -> Skip:
    """What a continuation from `cut` produces again: the tokens and text sent after it."""
    return Skip(sent.token_ids[cut.ids:], sent.sent_text[cut.chars:])


def generate_request(rendered: Any, sent_body: dict[str, Any], sent: StreamTracker,
                     cut: Cut) -> dict[str, Any] | None:
    """Build vLLM's token-in request that continues the answer from a cut.

    vLLM's token-in request (`POST /inference/v1/generate`) that continues the answer from
    `cut`: the prompt `/v1/chat/completions/render` made from the same chat request, which
    must be exactly the first prompt, then the tokens sent up to the cut; text out, streamed.
    None when the prompt differs or nothing is left to generate."""
    if isinstance(rendered, list) and len(rendered) == 1:
        rendered = rendered[0]
    if (not isinstance(rendered, dict) or sent.prompt_ids is None
            or rendered.get("token_ids") != sent.prompt_ids):
        return None
    req = dict(rendered)
    req["token_ids"] = sent.prompt_ids + sent.token_ids[:cut.ids]
    params = dict(req.get("sampling_params") or {})
    # vLLM's render leaves out fields equal to SamplingParams' defaults: a client's
    # max_tokens of exactly 16 would be lost, and /generate would then run to the model's
    # length. The client's own limit is the one to keep.
    asked = sent_body.get("max_completion_tokens", sent_body.get("max_tokens"))
    if _is_int(asked):
        params["max_tokens"] = asked
    if _is_int(params.get("max_tokens")):
        params["max_tokens"] -= cut.ids
        if params["max_tokens"] <= len(sent.token_ids) - cut.ids:
            return None  # the answer ends within what the client has
    if _is_int(params.get("min_tokens")):
        params["min_tokens"] = max(0, params["min_tokens"] - cut.ids)
    params["detokenize"] = True
    req.update(sampling_params=params, stream=True, output_mode="text")
    if sent_body.get("ec_transfer_params") is not None:  # metadata-only items load from EPD
        req["ec_transfer_params"] = sent_body["ec_transfer_params"]
    return req


def rendered_params(rendered: Any) -> dict[str, Any] | None:
    """The sampling parameters in a `/v1/chat/completions/render` answer."""
    if isinstance(rendered, list) and len(rendered) == 1:
        rendered = rendered[0]
    if isinstance(rendered, dict) and isinstance(rendered.get("sampling_params"), dict):
        return rendered["sampling_params"]
    return None


class GenerateToChat:
    """Turn vLLM's token-in stream into the chat chunks of the stream it continues.

    Turns vLLM's token-in stream (`{"choices": [{"text", "token_ids", "finish_reason"}]}`)
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
            body = json_decode(event[6:])
        except DecodeError:
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
        out = {"id": self.stream_id, "object": "chat.completion.chunk", "model": self.model,
               "choices": choices}
        return b"data: " + json_encode(out) + b"\n\n"
