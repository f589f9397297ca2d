"""The differential conformance harness: EPD answers must equal plain vLLM's.

The differential conformance harness: generated requests answered through EPD must equal the
same requests answered by one aggregated vLLM server of the same model, token for token and
character for character.

Cases come from a seeded generator (`cases`; the same bytes for a seed, but for OGG
files, whose stream serial libsndfile draws at random: their decoded audio is the same, their
item ids differ run to run): images of several sizes, modes and formats (EXIF
rotation, transparency, palette, grayscale, CMYK, WebP), videos as JPEG frame lists or mp4
(odd and even frame counts, sizes, fps), audio at 8-48 kHz, mono or stereo, wav/flac/ogg;
one to three items per request, sometimes several turns, and sampling fields (greedy with
min/max tokens, ignore_eos, stop token ids, logit bias, penalties, stop strings; seeded
sampling). Each case runs on a path (`PATHS`): its first encode, a cache hit (the same request
again), or failover (a streamed answer whose decode instance breaks off mid-stream; see
`CuttingProxy`). `benchmarks/serving/conformance.py` starts the stacks and prints the
table; the CI slice runs a fixed few cases in tests/e2e.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import random
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from PIL import Image

from encoder_service.local.requests import AUDIO_SUBTYPES, mp4_bytes

PATHS = ("first", "hit", "failover")
PROMPTS = ("describe this", "what do you see and hear?", "tell a long story about it",
           "list three things", "is it loud or quiet?")


@dataclass
class Case:
    """One generated request and what it is made of (for the report)."""

    seed: int
    body: dict[str, Any]
    kinds: list[str] = field(default_factory=list)  # e.g. ["image:RGBA/png/37x90"]

    def request(self, model: str, stream: bool = False) -> dict[str, Any]:
        body = copy.deepcopy(self.body)
        body["model"] = model
        body["return_token_ids"] = True
        if stream:
            body["stream"] = True
        return body


# -- media ------------------------------------------------------------------------------------

def _image(rng: random.Random) -> tuple[dict[str, Any], str]:
    w, h = rng.randint(24, 160), rng.randint(24, 160)
    arr = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (h, w, 4), dtype=np.uint8)
    mode = rng.choice(["RGB", "RGBA", "L", "P", "CMYK", "LA"])
    fmt = {"CMYK": "JPEG", "LA": "PNG", "P": "PNG"}.get(mode) or rng.choice(["PNG", "JPEG",
                                                                              "WEBP"])
    if fmt == "JPEG" and mode in ("RGBA", "LA", "P"):
        fmt = "PNG"
    im = Image.fromarray(arr, "RGBA")
    if mode == "P":
        im = im.convert("RGB").quantize(16)
        if rng.random() < 0.5:
            im.info["transparency"] = 0
    else:
        im = im.convert(mode)
    buf = io.BytesIO()
    kwargs: dict[str, Any] = {}
    exif = None
    if fmt == "JPEG" and rng.random() < 0.5:  # a phone photo: EXIF orientation
        exif = Image.Exif()
        exif[0x0112] = rng.choice([3, 6, 8])
        kwargs["exif"] = exif.tobytes()
    im.save(buf, format=fmt, **kwargs)
    mime = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}[fmt]
    url = f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode()
    tag = f"image:{mode}/{fmt.lower()}/{w}x{h}" + ("/exif" if exif is not None else "")
    return {"type": "image_url", "image_url": {"url": url}}, tag


def _frames(rng: random.Random, n: int, w: int, h: int) -> list[np.ndarray]:
    g = np.random.default_rng(rng.getrandbits(32))
    base = g.integers(0, 256, (h, w, 3), dtype=np.uint8)
    return [np.roll(base, 3 * i, axis=1) for i in range(n)]


def _video(rng: random.Random) -> tuple[dict[str, Any], str]:
    n = rng.randint(2, 9)
    w, h = rng.choice([(64, 48), (96, 64), (128, 96), (112, 112), (80, 120)])
    frames = _frames(rng, n, w, h)
    if rng.random() < 0.5:
        parts = []
        for f in frames:
            buf = io.BytesIO()
            Image.fromarray(f).save(buf, format="JPEG")
            parts.append(base64.b64encode(buf.getvalue()).decode())
        url = "data:video/jpeg;base64," + ",".join(parts)
        tag = f"video:jpeg-list/{n}f/{w}x{h}"
    else:
        fps = rng.choice([2, 4, 10, 24])
        url = "data:video/mp4;base64," + base64.b64encode(mp4_bytes(frames, fps)).decode()
        tag = f"video:mp4/{n}f/{w}x{h}/{fps}fps"
    return {"type": "video_url", "video_url": {"url": url}}, tag


def audio(rng: random.Random, rate: int, channels: int, fmt: str, seconds: float) -> bytes:
    import soundfile

    g = np.random.default_rng(rng.getrandbits(32))
    t = np.arange(int(seconds * rate)) / rate
    tone = rng.uniform(120, 900)
    wave = 0.3 * np.sin(2 * np.pi * tone * t)[:, None] + 0.05 * g.standard_normal(
        (t.size, channels))
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype("float32"), rate, format=fmt, subtype=AUDIO_SUBTYPES[fmt])
    return buf.getvalue()


def _audio(rng: random.Random) -> tuple[dict[str, Any], str]:
    rate = rng.choice([8000, 16000, 22050, 32000, 44100, 48000])
    channels = rng.choice([1, 2])
    fmt = rng.choice(["WAV", "FLAC", "OGG"])
    seconds = round(rng.uniform(0.5, 3.0), 2)
    data = audio(rng, rate, channels, fmt, seconds)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(),
                                                   "format": fmt.lower()}}
    return part, f"audio:{fmt.lower()}/{rate}Hz/{channels}ch/{seconds}s"


_MEDIA = {"image": _image, "video": _video, "audio": _audio}


# -- requests ---------------------------------------------------------------------------------

def _sampling(rng: random.Random) -> dict[str, Any]:
    """Draw a request's sampling fields, greedy or seeded.

    Request fields: mostly greedy (comparable token for token), sometimes seeded
    sampling (comparable too: same seed, same draws)."""
    out: dict[str, Any] = {"max_tokens": rng.choice([4, 8, 16, 24, 40])}
    if rng.random() < 0.2:
        out.update(temperature=round(rng.uniform(0.5, 1.2), 2), seed=rng.randint(0, 10**6))
    else:
        out["temperature"] = 0.0
    for key, make, p in (
            ("ignore_eos", lambda: True, 0.3),
            ("min_tokens", lambda: rng.randint(1, 6), 0.2),
            ("stop_token_ids", lambda: [rng.randint(3, 60)], 0.15),
            ("logit_bias", lambda: {str(rng.randint(3, 200)): rng.choice([-8, 5])}, 0.15),
            ("repetition_penalty", lambda: round(rng.uniform(1.05, 1.6), 2), 0.15),
            ("presence_penalty", lambda: round(rng.uniform(0.1, 1.0), 2), 0.1),
            ("frequency_penalty", lambda: round(rng.uniform(0.1, 1.0), 2), 0.1),
            ("stop", lambda: [rng.choice(["the", "a", "o", "\n"])], 0.1)):
        if rng.random() < p:
            out[key] = make()
    return out


def make_case(seed: int, modalities: tuple[str, ...] = ("image", "video", "audio")) -> Case:
    rng = random.Random(seed)
    n_items = rng.choice([1, 1, 1, 2, 2, 3])
    parts, kinds = [], []
    for _ in range(n_items):
        part, tag = _MEDIA[rng.choice(modalities)](rng)
        parts.append(part)
        kinds.append(tag)
    content = [*parts, {"type": "text", "text": rng.choice(PROMPTS)}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if rng.random() < 0.25:  # multi-turn: an earlier answer, then a text follow-up
        messages += [{"role": "assistant", "content": "it is " + rng.choice(["red", "loud",
                                                                             "a cat"])},
                     {"role": "user", "content": rng.choice(PROMPTS)}]
        kinds.append("multi-turn")
    body = {"messages": messages, **_sampling(rng)}
    kinds += [k for k in body if k not in ("messages", "max_tokens", "temperature")]
    return Case(seed, body, kinds)


def cases(seed: int, n: int, modalities: tuple[str, ...] = ("image", "video", "audio")
          ) -> list[Case]:
    return [make_case(seed * 100_003 + i, modalities) for i in range(n)]


# -- answers ----------------------------------------------------------------------------------

@dataclass
class Answer:
    status: int
    token_ids: list[int]
    text: str
    error: str | None = None

    def same(self, other: Answer) -> bool:
        return (self.status == other.status == 200 and self.token_ids == other.token_ids
                and self.text == other.text)


def ask(client: httpx.Client, url: str, body: dict[str, Any]) -> Answer:
    """The answer of `url` to `body`, streamed or not, as ids and text."""
    if not body.get("stream"):
        r = client.post(url + "/v1/chat/completions", json=body)
        if r.status_code != 200:
            return Answer(r.status_code, [], "", r.text[:300])
        choice = r.json()["choices"][0]
        return Answer(200, choice.get("token_ids") or [],
                      (choice.get("message") or {}).get("content") or "")
    ids: list[int] = []
    text: list[str] = []
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return Answer(r.status_code, [], "", r.read().decode(errors="replace")[:300])
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return Answer(502, ids, "".join(text), json.dumps(event)[:300])
            for c in event.get("choices") or ():
                ids += c.get("token_ids") or []
                text.append((c.get("delta") or {}).get("content") or "")
    return Answer(200, ids, "".join(text))


# -- faults -----------------------------------------------------------------------------------

class CuttingProxy:
    """An HTTP proxy that cuts streamed answers off mid-stream, to test failover.

    An HTTP proxy in front of one decode instance that breaks each streamed chat answer
    off after a seeded number of events, 2 to `max_events` - 1 of them passed on (a real TCP
    close mid-stream, as a dying instance does), except the continuations the gateway opens
    (their request id ends in `-resume-decN`). Other requests pass through."""

    def __init__(self, upstream: str, port: int, seed: int, max_events: int = 24) -> None:
        self.upstream, self.port = upstream, port
        self.rng = random.Random(seed)
        self.max_events = max_events
        self.cuts = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: Any = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> CuttingProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("cutting proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def _run(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, web

        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        session: ClientSession | None = None

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            headers = {k: v for k, v in request.headers.items()
                       if k.lower() in ("content-type", "authorization", "x-request-id")}
            streamed = b'"stream":true' in body.replace(b" ", b"")
            rid = request.headers.get("x-request-id", "")
            # the cut comes after the role chunk and at least one token: a stream that
            # breaks before its first token is a new request for the gateway (retried, not
            # continued), which decoders.py's tests cover
            cut_after = (self.rng.randint(3, max(3, self.max_events))
                         if streamed and "-resume" not in rid
                         and request.path == "/v1/chat/completions" else None)
            assert session is not None
            async with session.request(request.method, self.upstream + request.path_qs,
                                       data=body, headers=headers) as up:
                resp = web.StreamResponse(status=up.status, headers={
                    "content-type": up.headers.get("content-type", "application/json")})
                await resp.prepare(request)
                events, pending = 0, b""
                async for chunk in up.content.iter_any():
                    if cut_after is None:
                        await resp.write(chunk)
                        continue
                    # event by event, however the bytes were chunked: cut_after - 1 pass
                    pending += chunk
                    *whole, pending = pending.split(b"\n\n")
                    for event in whole:
                        events += 1
                        if events >= cut_after:
                            self.cuts += 1
                            request.transport.abort()  # the instance "dies" mid-stream
                            return resp
                        await resp.write(event + b"\n\n")
                if pending:
                    await resp.write(pending)
                await resp.write_eof()
                return resp

        async def start() -> None:
            nonlocal session
            session = ClientSession(timeout=ClientTimeout(total=600))
            app = web.Application(client_max_size=1 << 28)
            app.router.add_route("*", "/{tail:.*}", handle)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

        loop.run_until_complete(start())
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        if session is not None:
            loop.run_until_complete(session.close())
        loop.close()
