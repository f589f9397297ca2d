"""`epd gateway`: serve the gateway from a config file (JSON or TOML) and/or flags."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ec_connectors.protocol.ports import GATEWAY_PORT
from encoder_service.gateway.config import GatewayConfig, GatewayConfigError
from epd_common.config_files import read_config_file


def config_from_argv(argv: list[str]) -> GatewayConfig:
    """The GatewayConfig `epd gateway argv` serves (GatewayConfigError when invalid)."""
    p = argparse.ArgumentParser(prog="epd gateway", description="OpenAI-compatible EPD "
                                "endpoint: encoders + prefill/decode instances behind one URL")
    p.add_argument("--config", type=Path, help="gateway config file (.json or .toml)")
    p.add_argument("--host")
    p.add_argument("--port", type=int, help=f"default {GATEWAY_PORT} (as `epd up`)")
    p.add_argument("--model", help="served model name")
    p.add_argument("--encoder", action="append", default=[], help="encoder base URL (repeat)")
    p.add_argument("--decoder", action="append", default=[], help="decode base URL (repeat)")
    p.add_argument("--prefill", action="append", default=[], help="E/P/D: prefill instance "
                   "base URL (repeat): it prefills, a --decoder loads its KV cache")
    p.add_argument("--storage-path", help="safetensors transport directory (enables "
                   "skipping items that are already encoded)")
    p.add_argument("--api-key", action="append", default=[], help="a key clients must send "
                   "as `Authorization: Bearer <key>` (repeat; as `vllm serve --api-key`; "
                   "prefer --api-keys-file or $EPD_GATEWAY_API_KEY: argv is visible to `ps`)")
    p.add_argument("--api-keys-file", help="client keys, one per line (several clients)")
    args = p.parse_args(argv)
    data = read_config_file(args.config, error=GatewayConfigError) if args.config else {}
    for key in ("host", "port", "model"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    for key, urls in (("encoders", args.encoder), ("decoders", args.decoder),
                      ("prefills", args.prefill)):
        if urls:
            data[key] = urls
    if args.api_key:
        data["api_keys"] = [*data.get("api_keys", []), *args.api_key]
    if args.api_keys_file:
        data["api_keys_file"] = args.api_keys_file
    if args.storage_path:
        data["availability"] = {**data.get("availability", {}), "kind": "safetensors",
                                "storage_path": args.storage_path}
    return GatewayConfig.build(data)


def main(argv: list[str]) -> int:
    try:
        cfg = config_from_argv(argv)
    except GatewayConfigError as exc:
        print(f"epd gateway: {exc}", file=sys.stderr)
        return 2
    from encoder_service.gateway.server import serve

    keys = len(cfg.client_api_keys)
    print(f"epd gateway: serving {cfg.model} on http://{cfg.host}:{cfg.port} "
          f"(encoders {cfg.encoders or 'none'}, decoders {cfg.decoders}"
          + (f", prefills {cfg.prefills}" if cfg.prefills else "") + "); "
          + (f"clients need one of {keys} API key(s)" if keys else "no client API key "
             "(--api-keys-file, --api-key or $EPD_GATEWAY_API_KEY set one)"), flush=True)
    serve(cfg)
    return 0
