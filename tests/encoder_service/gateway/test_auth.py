"""API keys, both directions of the gateway, over real HTTP: the real gateway app (uvicorn)
with client keys, in front of stand-in upstreams guarded by vLLM's own API-key middleware with
the key derived from the deployment secret (what `epd up`, compose and Kubernetes start)."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ec_connectors.protocol.api_keys import api_key, export_api_key, server_api_key
from ec_connectors.protocol.secret_file import read_secret
from encoder_service.gateway.auth import CLIENT_KEY_ENV, client_keys, read_keys_file
from encoder_service.gateway.config import GatewayConfig, GatewayConfigError
from encoder_service.gateway.server import GatewayThread
from encoder_service.local.processes import metric_value
from encoder_service.local.requests import chat_body, sample_image_png
from tests.helpers import Served, free_port, port_block, wait_for

MODEL = "tiny-llava"
PORTS = iter(port_block(__name__))
CLIENT_A, CLIENT_B = "client-a-key-0001", "client-b-key-0002"
REFUSED = 'epd_gateway_rejected_total{reason="invalid_api_key"}'


def port() -> int:
    return free_port(PORTS)


def secret_file(tmp_path, value: bytes = b"auth-test-deployment-secret-0123") -> str:
    path = tmp_path / f"secret-{value[-4:].hex()}"
    path.write_bytes(value)
    path.chmod(0o600)
    return str(path)


class Upstream:
    """A stand-in vLLM server (encoder or decode instance) behind vLLM's own
    AuthenticationMiddleware: it records the Authorization header of every call it admits."""

    def __init__(self, role: str, key: str) -> None:
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        self.seen: list[tuple[str, str | None]] = []  # (path, Authorization) admitted

        async def chat(request: Request):
            self.seen.append((request.url.path, request.headers.get("authorization")))
            body = await request.json()
            if role == "encoder":
                ids = [p["uuid"] for m in body["messages"] for p in m["content"]
                       if isinstance(p, dict) and "uuid" in p]
                return JSONResponse({"choices": [], "ec_transfer_params": {
                    "epd": {"items": {i: {"by": role} for i in ids}}}})
            return JSONResponse({"choices": [{"message": {"content": "ok"}}]})

        async def completions(request: Request):  # the gateway's probes and /v1/completions
            self.seen.append((request.url.path, request.headers.get("authorization")))
            return JSONResponse({"choices": [{"text": "."}]})

        async def models(request: Request):
            return JSONResponse({"data": [{"id": MODEL}]})

        async def health(request: Request):
            return JSONResponse({})

        app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                Route("/v1/completions", completions, methods=["POST"]),
                                Route("/v1/models", models), Route("/health", health)])
        app.add_middleware(AuthenticationMiddleware, tokens=[key])  # as vLLM adds it
        self.served = Served(app, port())
        self.url = self.served.url


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """Upstreams keyed with the deployment key; a gateway holding the secret whose clients
    need key A (config) or key B (keys file)."""
    tmp = tmp_path_factory.mktemp("auth")
    secret = secret_file(tmp)
    key = api_key(read_secret(secret))
    enc, dec = Upstream("encoder", key), Upstream("decoder", key)
    keys = tmp / "clients"
    keys.write_text(f"# one key per client\n{CLIENT_B}\n\n")
    with enc.served, dec.served:
        cfg = GatewayConfig.build({
            "port": port(), "model": MODEL, "encoders": [enc.url], "decoders": [dec.url],
            "secret_file": secret, "api_keys": [CLIENT_A], "api_keys_file": str(keys),
            "routing": {"probe_interval_s": 0.2}})
        g = GatewayThread(cfg).start()
        try:
            yield {"gw": g.url, "enc": enc, "dec": dec, "key": key, "secret": secret}
        finally:
            g.stop()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_clients_without_a_valid_key_get_openai_401s_and_nothing_goes_upstream(deployment):
    d = deployment
    enc, dec = d["enc"], d["dec"]
    body = chat_body(MODEL, sample_image_png(1), "hi", max_tokens=4)
    calls = (len(enc.seen), len(dec.seen))
    with httpx.Client(base_url=d["gw"], timeout=10) as c:
        refused_before = metric_value(c.get("/metrics").text, REFUSED)
        for headers in ({}, bearer("wrong"), bearer(d["key"]),  # the servers' key is no client key
                        {"authorization": CLIENT_A}, {"authorization": f"Basic {CLIENT_A}"}):
            for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                 ("GET", "/v1/models")):
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (headers, path, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"]  # OpenAI's shape
                assert "Authorization: Bearer" in err["message"]
                assert r.headers["www-authenticate"] == "Bearer"
        # health and metrics stay open
        assert c.get("/health").status_code == 200
        refused = metric_value(c.get("/metrics").text, REFUSED)
    assert refused == refused_before + 15
    # nothing reached an upstream meanwhile but the gateway's own probes
    for up, before in ((enc, calls[0]), (dec, calls[1])):
        assert {path for path, _ in up.seen[before:]} <= {"/v1/completions"}


def test_each_client_key_works_and_upstreams_see_only_the_deployment_key(deployment):
    d = deployment
    enc, dec = d["enc"], d["dec"]
    with httpx.Client(base_url=d["gw"], timeout=10) as c:
        for i, key in enumerate((CLIENT_A, CLIENT_B)):
            enc_before, dec_before = len(enc.seen), len(dec.seen)
            r = c.post("/v1/chat/completions", headers=bearer(key),
                       json=chat_body(MODEL, sample_image_png(10 + i), "hi", max_tokens=4))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "ok"
            # the image was encoded (encoder call) and answered (decode call)
            for up, before in ((enc, enc_before), (dec, dec_before)):
                assert "/v1/chat/completions" in {path for path, _ in up.seen[before:]}
            r = c.post("/v1/completions", headers=bearer(key),
                       json={"model": MODEL, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert c.get("/v1/models", headers=bearer(key)).status_code == 200
        # probes are keyed too: both instances pass them (/instances wants a client key)
        listed = lambda: c.get("/instances", headers=bearer(CLIENT_A)).json()  # noqa: E731
        assert wait_for(lambda: all(e.get("probe", {}).get("ok") for e in [
            *listed()["encoders"], *listed()["decoders"]]), timeout=5, interval=0.1)
    # every call the upstreams admitted carried the deployment's key, never a client's
    assert {a for _, a in enc.seen} == {a for _, a in dec.seen} == {f"Bearer {d['key']}"}


def test_a_gateway_without_the_secret_is_refused_upstream_and_says_so(deployment):
    d = deployment
    cfg = GatewayConfig.build({"port": port(), "model": MODEL, "encoders": [d["enc"].url],
                               "decoders": [d["dec"].url], "routing": {"probe_interval_s": 0}})
    with GatewayThread(cfg) as g, httpx.Client(base_url=g.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json=chat_body(MODEL, sample_image_png(3), "hi"))
        # the decode instance's 401 is the deployment's problem, never the client's: a 502
        assert r.status_code == 502, r.text
        assert "refused the gateway's API key" in r.json()["error"]["message"]


def test_client_keys_from_config_file_and_environment(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("k1\n# comment\n  k2  \nk1\n")
    assert client_keys(["k0"], str(keys), env={CLIENT_KEY_ENV: "k3"}) == ["k0", "k1", "k2", "k3"]
    assert client_keys([], None, env={}) == []
    empty = tmp_path / "empty"
    empty.write_text("# nobody\n\n")
    for path, words in ((empty, "holds no key"), (tmp_path / "missing", "cannot read")):
        with pytest.raises(ValueError, match=words):
            read_keys_file(path)
        with pytest.raises(GatewayConfigError, match="api_keys_file"):
            GatewayConfig.build({"decoders": ["http://a:1"], "api_keys_file": str(path)})
    monkeypatch.setenv(CLIENT_KEY_ENV, "from-env")
    cfg = GatewayConfig.build({"decoders": ["http://a:1"], "api_keys": ["k9"]})
    assert cfg.client_api_keys == ["k9", "from-env"]
    assert "k9" not in repr(cfg)  # keys never land in a logged config


def test_the_deployment_key_comes_from_the_secret_only(tmp_path, monkeypatch):
    path = secret_file(tmp_path)
    other = secret_file(tmp_path, b"another-deployment-secret-456789")
    key = api_key(read_secret(path))
    assert len(key) == 64 and key == api_key(read_secret(path))
    assert key != api_key(read_secret(other))
    assert read_secret(path).decode() not in key
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("EPD_SECRET_FILE", raising=False)
    assert server_api_key() is None
    assert server_api_key(path) == key
    env = {"EPD_SECRET_FILE": path}
    assert export_api_key(env) and env["VLLM_API_KEY"] == key  # what `epd vllm serve` does
    env = {"EPD_SECRET_FILE": path, "VLLM_API_KEY": "set-by-hand"}
    assert export_api_key(env) and env["VLLM_API_KEY"] == "set-by-hand"
    assert not export_api_key({}) and not export_api_key({"VLLM_API_KEY": ""})


def test_the_keyed_upstream_stand_in_refuses_unkeyed_calls(deployment):
    """The stand-ins really enforce the key (so the tests above could fail)."""
    d = deployment
    for url in (d["enc"].url, d["dec"].url):
        assert httpx.post(url + "/v1/completions", json={}).status_code == 401
        assert httpx.get(url + "/health").status_code == 200

