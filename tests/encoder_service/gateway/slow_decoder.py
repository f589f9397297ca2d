"""A stand-in decode instance in its own process, so a test can SIGKILL it mid-stream and
start it again on the same port (test_decoders.py's in-flight counts): chat completions
streamed slowly with vLLM's token ids (a role chunk carrying the prompt's ids, then one token
every 50 ms), the token-in API a failover continues on (`/v1/chat/completions/render`,
`/inference/v1/generate`) and the probes' `/v1/completions`. Run as
`python -m tests.encoder_service.gateway.slow_decoder PORT [TOKENS]`."""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

PROMPT = [1, 2, 3]


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def make_app(tokens: int) -> web.Application:
    async def stream(request: web.Request, first: int, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        if chat:
            await resp.write(_event({"id": "c", "prompt_token_ids": PROMPT, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        for i in range(first, tokens):
            await asyncio.sleep(0.05)
            choice = ({"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "})
            await resp.write(_event({"id": "c", "choices": [
                {"index": 0, **choice, "token_ids": [100 + i], "finish_reason": None}]}))
        await resp.write(_event({"id": "c", "choices": [
            {"index": 0, **({"delta": {}} if chat else {"text": ""}),
             "finish_reason": "length"}]}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.json()
        return await stream(request, 0, True)

    async def render(request: web.Request) -> web.Response:
        return web.json_response({"token_ids": PROMPT, "sampling_params": {
            "temperature": 0.0, "max_tokens": tokens}})

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return await stream(request, len(body["token_ids"]) - len(PROMPT), False)

    async def completions(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "."}]})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/chat/completions/render", render)
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


if __name__ == "__main__":
    web.run_app(make_app(int(sys.argv[2]) if len(sys.argv) > 2 else 100), host="127.0.0.1",
                port=int(sys.argv[1]), print=None)
