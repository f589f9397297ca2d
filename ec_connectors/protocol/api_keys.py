"""The bearer keys derived from the deployment secret: the API key and the admin token.

The same secret (secret_file.py) yields the API key every vLLM server and encoder pool of
the deployment requires (`api_key`, passed in `$VLLM_API_KEY`, never on a command line) and
the gateway presents, and the token of a gateway's admin endpoints (`admin_token`). The
secret itself never travels.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from ec_connectors.protocol.secret_file import SECRET_ENV, derive_key, read_secret

API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable (its --api-key without the command line)


def admin_token(secret: bytes) -> str:
    """The bearer token of a gateway's admin endpoints.

    The bearer token of a gateway's admin endpoints (join/leave at run time): derived from
    the deployment secret, so the secret itself never travels (`epd admin-token` prints it)."""
    return hmac.new(derive_key(secret, "admin"), b"epd-admin", hashlib.sha256).hexdigest()


def api_key(secret: bytes) -> str:
    """The API key of the deployment's servers, derived from the secret.

    The key every vLLM server and encoder pool of the deployment requires on its API
    (`Authorization: Bearer <key>`), and the gateway presents: derived from the deployment
    secret ("epd api key v1"), so one secret gives one key and the secret never travels.
    `epd api-key` prints it."""
    return hmac.new(derive_key(secret, "api"), b"epd api key v1", hashlib.sha256).hexdigest()


def server_api_key(secret_file: str | os.PathLike | None = None) -> str | None:
    """The API key an EPD server requires, if any.

    The key an EPD server requires: `$VLLM_API_KEY` when set, else the key derived from
    the deployment secret (`secret_file`, else `$EPD_SECRET_FILE`), else None (no secret:
    loopback only, unkeyed)."""
    given = os.environ.get(API_KEY_ENV)
    if given:
        return given
    secret = read_secret(secret_file)
    return None if secret is None else api_key(secret)


def export_api_key(environ: dict[str, str] | None = None) -> bool:
    """Put the deployment's API key in `$VLLM_API_KEY` when it is unset.

    Put the deployment's key in `$VLLM_API_KEY` (of `environ`, default this process) when
    a secret is there and the variable is not set: how a vLLM server started by hand,
    compose or Kubernetes (`epd vllm serve`, the image's `vllm`) requires it without a
    command-line flag `ps` would show. Returns whether the variable is set now."""
    env = os.environ if environ is None else environ
    if not env.get(API_KEY_ENV):
        secret = read_secret(env.get(SECRET_ENV) or None)
        if secret is not None:
            env[API_KEY_ENV] = api_key(secret)
    return bool(env.get(API_KEY_ENV))
