"""The `epd up` command line.

`epd up` command line: flags over the config file (up_config.py), and `--demo`: the demo's
requests (demo.py) once the deployment is ready, then stop. It imports both; up.py imports
neither."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ec_connectors.protocol import ports
from encoder_service.gateway.config import GatewayConfigError
from encoder_service.local.demo import DEMO_MODEL, demo_requests
from encoder_service.local.processes import default_work_dir
from encoder_service.local.up import Deployment, run_up
from encoder_service.local.up_config import TIERS, UpError, load_up_config


def count(value: str) -> tuple[int, int | None]:
    """A role's size on the command line: N (fixed) or MIN:MAX (elastic, scaler.py)."""
    lo, sep, hi = value.partition(":")
    try:
        return (int(lo), int(hi) if sep else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give N or MIN:MAX") from None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="epd up", description="start a local EPD deployment: "
                                "encoder(s) + vLLM prefill/decode instance(s) + gateway")
    p.add_argument("--config", type=Path, help="deployment config (.json or .toml); "
                   "every key has a default")
    p.add_argument("--base-port", type=int, help=f"gateway port (default {ports.GATEWAY_PORT});"
                   " vLLM servers take the next ports")
    p.add_argument("--model", help="a test model built locally (tiny = LLaVA, qwen-vl, "
                   "qwen-omni, ...) or a model directory (default tiny; qwen-omni with --demo)")
    p.add_argument("--encoders", type=count, help="N, or MIN:MAX: elastic, added under load "
                   "and drained when idle (the config's scaling table)")
    p.add_argument("--decoders", type=count, help="prefill/decode instances (E+PD): N or "
                   "MIN:MAX")
    p.add_argument("--prefill", type=int, help="E/P/D: prefill instances, whose KV cache "
                   "vLLM's NixlConnector hands to the --decode instances")
    p.add_argument("--decode", type=count, help="E/P/D: decode instances (with --prefill): "
                   "N or MIN:MAX")
    p.add_argument("--transport", choices=["auto", *TIERS],
                   help="auto (default) = shm, same-host shared memory, where /dev/shm is a "
                   "tmpfs, else safetensors; tiered = mooncake, then mooncake_store, then "
                   "safetensors; with mooncake_store or tiered, `epd up` starts a Mooncake "
                   "Store master")
    p.add_argument("--master-port", type=int, help=f"Mooncake Store master RPC port "
                   f"(default {ports.MASTER_RPC_PORT}; metadata +1, metrics +2)")
    p.add_argument("--encoder-backend", choices=["vllm", "pool"])
    p.add_argument("--no-restart", action="store_true",
                   help="leave a server that exits unasked down (default: restarted with "
                   "backoff; the config's restart table)")
    p.add_argument("--demo", action="store_true",
                   help="send real image, video and audio requests through the gateway, "
                   "print them, stop")
    p.add_argument("--prompt", default="describe this")
    args = p.parse_args(argv)
    if args.decode is not None and args.decoders is not None:
        p.error("--decode (E/P/D) and --decoders (E+PD) are two modes: give one")
    if args.decode is not None and not args.prefill:
        p.error("--decode needs --prefill N (N >= 1); E+PD: --decoders")
    decoders = args.decoders if args.decode is None else args.decode
    scaling = {f"{role}_max": given[1] for role, given in (("encoders", args.encoders),
                                                           ("decoders", decoders)) if given}
    overrides = {k: v for k, v in (("base_port", args.base_port),
                                   ("encoders", args.encoders and args.encoders[0]),
                                   ("decoders", decoders and decoders[0]),
                                   ("scaling", scaling or None), ("prefills", args.prefill),
                                   ("transport", args.transport),
                                   ("encoder_backend", args.encoder_backend),
                                   ("master_port", args.master_port), ("model", args.model))
                 if v is not None}
    try:
        cfg = load_up_config(args.config, overrides)
        if args.demo and "model" not in cfg.model_fields_set:
            cfg = cfg.model_copy(update={"model": DEMO_MODEL})
        if args.no_restart:
            cfg = cfg.model_copy(update={"restart": cfg.restart.model_copy(
                update={"enabled": False})})
    except (UpError, GatewayConfigError) as exc:
        print(f"epd up: {exc}", file=sys.stderr)
        return 2
    work = default_work_dir()

    def demo(dep: Deployment) -> int:
        return demo_requests(dep, args.prompt)

    return run_up(cfg, work, demo if args.demo else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
