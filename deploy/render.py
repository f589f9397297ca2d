"""Render the deployment files from deploy/settings.toml and the templates in deploy/templates/.

docker-compose.yml, deploy/k8s/epd.yaml and the monitoring profile's
deploy/prometheus/prometheus.yml take their ports, keys and model paths from one place
(and the port scheme from ec_connectors/protocol/ports.py, the vLLM flags and the E/P/D
--kv-transfer-config from what `epd up` gives its servers). The same templates render the
NIXL variant ([nixl]: docker-compose.nixl.yml, deploy/k8s/epd-nixl.yaml,
deploy/prometheus/prometheus.nixl.yml): encoders serve NIXL reads peer to peer under stable
names. The rendered files are checked in: users apply them as they are.

    python deploy/render.py           write every file
    python deploy/render.py --check   exit 1 if a checked-in file differs from its rendering

A template names a setting as {{name}}; an unknown name, or one left over, is an error.
`{{#flag}}...{{/flag}}` keeps its text only in the variants with that flag, `{{^flag}}...{{/flag}}`
only in the others (the one flag: `nixl`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ec_connectors.config import EPDConfig  # noqa: E402
from ec_connectors.protocol import ports  # noqa: E402
from encoder_service.local.processes import SERVER_GUARD  # noqa: E402
from encoder_service.local.scale_rules import ScalingConfig  # noqa: E402
from encoder_service.local.testmodels import SPECS  # noqa: E402
from encoder_service.local.up_config import kv_connector_config  # noqa: E402

SETTINGS = ROOT / "deploy" / "settings.toml"
TEMPLATES = ROOT / "deploy" / "templates"
OUTPUTS = {"docker-compose.yml": ROOT / "docker-compose.yml",
           "epd.yaml": ROOT / "deploy" / "k8s" / "epd.yaml",
           "prometheus.yml": ROOT / "deploy" / "prometheus" / "prometheus.yml"}
# the NIXL variant ([nixl] in the settings): the same templates with the flag `nixl`
NIXL_OUTPUTS = {"docker-compose.yml": ROOT / "docker-compose.nixl.yml",
                "epd.yaml": ROOT / "deploy" / "k8s" / "epd-nixl.yaml",
                "prometheus.yml": ROOT / "deploy" / "prometheus" / "prometheus.nixl.yml"}
VARIANTS = {"default": (OUTPUTS, frozenset()), "nixl": (NIXL_OUTPUTS, frozenset({"nixl"}))}
# NIXL: the encoders' stable names, the ones their side channels bind and announce, the ones
# every consumer lists as `producers` (compose: the service; k8s: the StatefulSet's pods under
# their headless Service, one DNS name per pod)
COMPOSE_ENCODER = "encoder"
K8S_ENCODER, K8S_PEERS = "epd-encoder", "epd-encoder-peers"
DECODE_ARGS = ["--enable-scale-out"]  # as encoder_service/local/up.py DECODE_ARGS
HEADER = ("# Rendered from deploy/settings.toml and deploy/templates/{name} by deploy/render.py:"
          " edit those,\n# then run `python deploy/render.py` (tests/deploy/test_manifests.py"
          " checks this file is current).\n")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
_SECTION = re.compile(r"\{\{([#^])(\w+)\}\}(.*?)\{\{/\2\}\}", re.S)


def load_settings(path: Path = SETTINGS) -> dict[str, Any]:
    return tomllib.loads(path.read_text())


def vllm_args(s: dict[str, Any]) -> list[str]:
    """The flags every vLLM server gets: those of `epd up`'s servers (processes.VllmServer)."""
    v = s["vllm"]
    return ["--enforce-eager", "--max-model-len", str(v["max_model_len"]), "--max-num-seqs",
            str(v["max_num_seqs"]), "--runner", "generate", "--middleware", SERVER_GUARD]


def ec_config(s: dict[str, Any], role: str, master_host: str = "", *,
              tiers: list[str] | None = None, **extra: Any) -> str:
    """The --ec-transfer-config JSON of one server, validated as the connector will.

    `tiers`: the transport (default [connector]'s); the store's keys only where it is a tier."""
    c = s["connector"]
    tiers = list(tiers if tiers is not None else c["transport"])
    producer = role == "ec_producer"
    conf = {"transport": tiers, "storage_path": c["cache_path"], **extra}
    if "mooncake_store" in tiers:
        master = f"{master_host}:{ports.MASTER_RPC_PORT}"
        conf.update({"store_master": master, "store_metadata": ports.store_metadata_url(master),
                     "store_segment_bytes": c["store_segment_bytes"] if producer else 0,
                     "store_buffer_bytes": c["store_buffer_bytes"]})
    EPDConfig.from_dict(conf)  # a bad setting fails here, not in a pod
    return json.dumps({"ec_connector": "EPDConnector", "ec_role": role,
                       "ec_buffer_device": "cpu", "ec_connector_extra_config": conf},
                      separators=(",", ":"))


def kv_config(prefill: bool) -> str:
    """E/P/D: the --kv-transfer-config JSON of a prefill or decode instance: what `epd up
    --prefill N` gives its own (up_config.kv_connector_config)."""
    return json.dumps(kv_connector_config(prefill), separators=(",", ":"))


def kv_side_channels(s: dict[str, Any]) -> dict[str, int]:
    """E/P/D: each KV role's NIXL side channel, checked distinct and clear of every fixed
    port of the files and of the port plan (ports.DEFAULT_FIXED)."""
    kv = {"prefill": s["kv"]["prefill_side_channel"], "decode": s["kv"]["decode_side_channel"]}
    fixed = {**dict.fromkeys(ports.DEFAULT_FIXED, "the port plan (ports.py)"),
             **dict.fromkeys(ports.master_ports(ports.MASTER_RPC_PORT), "the store master"),
             s["ports"]["vllm"]: "the vLLM servers", s["ports"]["gateway"]: "the gateway"}
    if kv["prefill"] == kv["decode"]:
        raise ValueError(f"[kv]: prefill and decode side channels are both {kv['prefill']}")
    for role, port in kv.items():
        if not 1024 <= port <= 65535 or port in fixed:
            raise ValueError(f"[kv] {role}_side_channel = {port}: "
                             f"{fixed.get(port, 'out of range')} holds it")
    return kv


def nixl_ports(s: dict[str, Any], kv_ports: dict[str, int]) -> dict[str, int]:
    """NIXL: each encoder's side channel and announcements (rank 0; ports.py's scheme) and the
    UCX TCP listeners' range, checked: clear of every fixed port of the files and of each
    other, and room for each rank of a server (`ranks`)."""
    n = s["nixl"]
    side = n["side_channel"]
    first, last = n["ucx_tcp_ports"]
    ranks = n["ranks"]
    own = {**{p: "the side channels" for p in range(side, side + ranks)},
           **{ports.announce_port(p): "the announcements" for p in range(side, side + ranks)}}
    fixed = {s["ports"]["vllm"]: "the vLLM servers", s["ports"]["gateway"]: "the gateway",
             **{p: "the KV side channels" for p in kv_ports.values()}}
    if not 1024 <= side <= ports.announce_port(side + ranks - 1) <= 65535:
        raise ValueError(f"[nixl] side_channel = {side}: out of range")
    if not 1024 <= first <= last <= 65535 or last - first + 1 < ranks:
        raise ValueError(f"[nixl] ucx_tcp_ports = {first}-{last}: not a range of at least "
                         f"{ranks} ports (one listener per rank) in 1024-65535")
    for port, what in own.items():
        if port in fixed:
            raise ValueError(f"[nixl] side_channel = {side}: port {port} ({what}) is "
                             f"{fixed[port]}'s")
    # UCX's listeners also stay clear of the port plan (a default producer's ports, `epd up`'s)
    fixed = {**dict.fromkeys(ports.DEFAULT_FIXED, "the port plan (ports.py)"), **fixed, **own}
    hit = [p for p in range(first, last + 1) if p in fixed]
    if hit:
        raise ValueError(f"[nixl] ucx_tcp_ports = {first}-{last} holds port {hit[0]} "
                         f"({fixed[hit[0]]})")
    return {"side": side, "announce": ports.announce_port(side), "ucx_first": first,
            "ucx_last": last}


def nixl_values(s: dict[str, Any], kv_ports: dict[str, int]) -> dict[str, str]:
    """The NIXL variant's settings: the encoders' names, the consumers' `producers`, ports,
    UCX's environment, each --ec-transfer-config."""
    n = s["nixl"]
    tiers = list(n["transport"])
    if "nixl" not in tiers or {"mooncake", "mooncake_store"} & set(tiers):
        raise ValueError(f"[nixl] transport = {tiers}: must hold 'nixl' and neither "
                         "'mooncake' nor 'mooncake_store' (the variant runs no store master)")
    p = nixl_ports(s, kv_ports)
    side, first, last = p["side"], p["ucx_first"], p["ucx_last"]
    pool = {"memory_pool_bytes": n["memory_pool_bytes"], "base_port": side}
    peers = [f"{K8S_ENCODER}-{i}.{K8S_PEERS}:{side}"
             for i in range(int(s["autoscaling"]["encoders_max"]))]
    ucx_ports = list(range(first, last + 1))

    # k8s: one containerPort per UCX listener port (a pod spec has no port ranges)
    k8s_ucx = "".join(f"\n            - {{name: ucx-{i}, containerPort: {port}}}"
                      for i, port in enumerate(ucx_ports))

    return {
        "nixl_tiers": json.dumps(tiers), "nixl_side_port": str(side),
        "nixl_announce_port": str(p["announce"]),
        "ucx_tls": n["ucx_tls"], "ucx_net_devices": n["ucx_net_devices"],
        "ucx_port_range": f"{first}-{last}",
        "compose_ucx_expose": ", ".join(f'"{port}"' for port in ucx_ports),
        "k8s_ucx_ports": k8s_ucx,
        "k8s_encoders_max": str(len(peers)), "k8s_encoder_peers": K8S_PEERS,
        "producer_config": ec_config(s, "ec_producer", tiers=tiers, host=COMPOSE_ENCODER,
                                     **pool),
        "consumer_config": ec_config(s, "ec_consumer", tiers=tiers,
                                     producers=[f"{COMPOSE_ENCODER}:{side}"], **pool),
        "k8s_producer_config": ec_config(
            s, "ec_producer", tiers=tiers, host=f"$(POD_NAME).{K8S_PEERS}",
            max_storage_bytes=s["k8s"]["max_storage_bytes"], **pool),
        "k8s_consumer_config": ec_config(s, "ec_consumer", tiers=tiers, producers=peers,
                                         **pool),
    }


def autoscaling(s: dict[str, Any]) -> dict[str, str]:
    """The HPAs' and lifecycle hooks' settings: [autoscaling], and per role `epd up`'s
    scaling defaults (one rule for both), windows rounded up to whole seconds."""
    a, sc = s["autoscaling"], ScalingConfig()
    out = {"encoders_max": str(a["encoders_max"]), "decoders_max": str(a["decoders_max"]),
           "drain_timeout_s": str(a["drain_timeout_s"]), "startup_s": str(a["startup_s"]),
           "grace_s": str(int(a["drain_timeout_s"]) + 30),
           "k8s_gateway_url": f"http://epd-gateway:{s['ports']['gateway']}",
           "adapter_window": f"{max(1, math.ceil(sc.encoder.up_window_s))}s"}
    for role, p in (("encoder", sc.encoder), ("decode", sc.decode)):
        out.update({f"{role}_target": f"{p.target:g}",
                    f"{role}_up_window_s": str(math.ceil(p.up_window_s)),
                    f"{role}_idle_window_s": str(math.ceil(p.idle_window_s)),
                    f"{role}_up_cooldown_s": str(max(1, math.ceil(p.up_cooldown_s))),
                    f"{role}_down_cooldown_s": str(max(1, math.ceil(p.down_cooldown_s)))})
    return out


def values(s: dict[str, Any], variant: str = "default") -> dict[str, str]:
    """Every {{name}} the templates may use in a variant ("default" or "nixl")."""
    spec = SPECS[s["model"]["spec"]]
    models_dir = s["model"]["models_dir"].rstrip("/")
    rpc = ports.MASTER_RPC_PORT
    secret_k8s = s["secret"]["k8s"]
    kv_ports = kv_side_channels(s)
    # the Mooncake engines' range: clear of every fixed port of the files (the port plan)
    engine = ports.engine_env([s["ports"]["vllm"], s["ports"]["gateway"],
                               *ports.master_ports(rpc), *kv_ports.values()], {})

    def k8s_list(args: list[str]) -> str:
        return ", ".join(json.dumps(a) for a in args)

    return {
        "image": s["image"], "model_spec": spec.name, "served_name": spec.model_name,
        "models_dir": models_dir, "model_path": f"{models_dir}/{spec.model_name}",
        "vllm_port": str(s["ports"]["vllm"]), "gateway_port": str(s["ports"]["gateway"]),
        "published_port": str(s["ports"]["published"]),
        "published_kv_port": str(s["ports"]["published_kv"]),
        "kv_prefill_port": str(kv_ports["prefill"]), "kv_decode_port": str(kv_ports["decode"]),
        "kv_prefill_config": kv_config(prefill=True), "kv_decode_config": kv_config(prefill=False),
        "master_rpc": str(rpc), "master_http": str(ports.master_http_port(rpc)),
        "master_metrics": str(ports.master_metrics_port(rpc)),
        "engine_min": engine[ports.ENGINE_MIN_ENV], "engine_max": engine[ports.ENGINE_MAX_ENV],
        "secret_compose": s["secret"]["compose"], "secret_k8s": secret_k8s,
        "secret_k8s_dir": secret_k8s.rsplit("/", 1)[0],
        "cache_path": s["connector"]["cache_path"],
        "vllm_args": " ".join(vllm_args(s)), "decode_args": " ".join(DECODE_ARGS),
        "k8s_vllm_args": k8s_list(vllm_args(s)), "k8s_decode_args": k8s_list(DECODE_ARGS),
        "producer_config": ec_config(s, "ec_producer", "mooncake-master"),
        "consumer_config": ec_config(s, "ec_consumer", "mooncake-master"),
        "k8s_producer_config": ec_config(s, "ec_producer", "epd-mooncake-master",
                                         max_storage_bytes=s["k8s"]["max_storage_bytes"]),
        "k8s_consumer_config": ec_config(s, "ec_consumer", "epd-mooncake-master"),
        **autoscaling(s),
        **(nixl_values(s, kv_ports) if variant == "nixl" else {}),
    }


def render_text(template: str, vals: dict[str, str],
                flags: frozenset[str] = frozenset()) -> str:
    def section(m: re.Match) -> str:
        return m.group(3) if (m.group(2) in flags) == (m.group(1) == "#") else ""

    def sub(m: re.Match) -> str:
        if m.group(1) not in vals:
            raise KeyError(f"unknown setting {{{{{m.group(1)}}}}} in a template")
        return vals[m.group(1)]

    return _PLACEHOLDER.sub(sub, _SECTION.sub(section, template))


def render(settings: dict[str, Any] | None = None) -> dict[Path, str]:
    """{output path: its text} for every template, in every variant."""
    s = settings if settings is not None else load_settings()
    out: dict[Path, str] = {}
    for variant, (outputs, flags) in VARIANTS.items():
        vals = values(s, variant)
        for name, path in outputs.items():
            out[path] = HEADER.format(name=name) + render_text(
                (TEMPLATES / name).read_text(), vals, flags)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare, write nothing")
    args = p.parse_args(argv)
    stale = []
    for path, text in render().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.relative_to(ROOT))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"stale: {', '.join(map(str, stale))}: run `python deploy/render.py`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
