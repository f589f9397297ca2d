"""The rival benchmark's deployments (rivals/run.py), each started fresh, on this
machine's two cores, behind one front end, every server through the handoff probe
(probe.py):

  aggregated     one vLLM server (encoder and prefill/decode in one), both cores, asked
                 directly (it has nothing to route)
  ec_example     vLLM encoder (ec_producer, core 0) + vLLM prefill/decode (ec_consumer,
                 core 1) with vLLM's ECExampleConnector (safetensors files on /dev/shm),
                 our gateway in front (item ids, routing; no availability lookup and no
                 overlap: the connector has neither)
  ec_mooncake    the same two servers with vLLM's ECMooncakeConnector over the Transfer
                 Engine's TCP, cpu buffers; mooncake_front.py in front (it pushes: the front
                 picks the consumer before the encode, both requests carry the transfer ids)
  ours_shm       `epd up`'s servers: vLLM encoder + vLLM prefill/decode with EPDConnector
                 over shared memory, our gateway as `epd up` configures it
  ours_te        the same over the Mooncake Transfer Engine transport (TCP, loopback)
  ours_nixl      the same over the NIXL transport (UCX on loopback; not in the default run)
  ours_fs        the same over safetensors files (not in the default run)
  ours_pool_shm  the same as ours_shm with our encoder pool (`epd encoder`) on core 0
  vllm_epd       E/P/D as vLLM's disaggregated-encoder proxy example runs it: a vLLM encoder
                 (ECExampleConnector ec_producer, core 0), a prefill instance
                 (ECExampleConnector ec_consumer + NixlConnector kv_both, cpu buffers) and a
                 decode instance (NixlConnector kv_both, cpu buffers), both on core 1;
                 epd_front.py in front (encode, prefill, decode, one after another)
  ours_epd       `epd up --prefill 1 --decode 1` (shm transport): the encoder on core 0, the
                 decode and the prefill instance on core 1, its gateway
  (vllm_epd and vllm_pd_text run NIXL's progress thread, as vLLM does: set
  RIVAL_NIXL_PROGRESS_THREAD=0 to give them the quiet agent of ours as well)
  vllm_pd_text   vLLM's plain P/D, no encoder and no EC connector: the prefill and the decode
                 instance of vllm_epd (NixlConnector only), epd_front.py in front; text
                 prompts only (workloads.TEXT_RUNNERS): what NixlConnector costs here
                 at the least
  vllm_pd_router the prefill and decode instances of vllm_pd_text behind vLLM's Rust router
                 (`vllm-router --vllm-pd-disaggregation --kv-connector nixl`, installed into
                 a side environment on first use: harness/router.py): the field's P/D front
(the last four are not in the default run: `--deployments ...` or `--epd`)

vLLM's own deployments run plain `vllm serve` (no `--middleware`: our server guard is part of
our deployment, as the README runs it); ours run exactly what `epd up` starts. Fronts run as
processes of their own, unpinned, as the benchmark's client does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from benchmarks.harness import video
from benchmarks.harness.env import pythonpath_env
from benchmarks.harness.processes import example_config, start_gateway
from benchmarks.harness.router import ROUTER_ENV, RouterProcess, router_binary
from benchmarks.harness.stack import Stack
from benchmarks.rivals import epd_front, mooncake_front
from benchmarks.rivals.probe import PROBE_ENV, V1_NO_FORWARD_ENV
from encoder_service.local.processes import (
    ManagedProcess,
    PoolServer,
    VllmServer,
    start_all,
)
from encoder_service.local.testmodels import SPECS, ModelSpec, build
from encoder_service.local.up import Deployment
from encoder_service.local.up_config import UpConfig, gateway_routing

EPD = ("vllm_epd", "ours_epd", "vllm_pd_text", "vllm_pd_router")  # P and D apart
DEPLOYMENTS = ("aggregated", "ec_example", "ec_mooncake", "ours_shm", "ours_te", "ours_fs",
               "ours_nixl", "ours_pool_shm", *EPD)
DEFAULT_DEPLOYMENTS = tuple(d for d in DEPLOYMENTS
                            if d not in ("ours_fs", "ours_nixl") and d not in EPD)
RIVALS = ("ec_example", "ec_mooncake")  # vLLM's connectors; aggregated is the reference
TEXT_ONLY = ("vllm_pd_text", "vllm_pd_router")  # no encoder: text prompts only
BASE_PORT = 20800  # front; servers +1, +2, +3; ECMooncake control ports +60, +61
NIXL_SIDE_CHANNEL_PORT = BASE_PORT + 40  # vLLM's P/D deployments: prefill; decode +1
MOONCAKE_BASE_PORT = 15900  # our TE transport's side channels (announce +1000, data +2000)
PROBE = "benchmarks.rivals.probe"  # every server's module, in place of vLLM's or the pool's


@dataclass(frozen=True)
class Group:
    """A model and what every server of every deployment gets for it."""

    name: str
    spec: ModelSpec
    vllm_args: tuple[str, ...] = ()
    media_io: dict | None = None
    gateway: dict = field(default_factory=dict)  # gateway config keys (limits)
    buffer_bytes: int = 256 << 20  # ECMooncake ec_buffer_size, our TE pool, our shm sizes

    @property
    def served(self) -> str:
        return self.spec.model_name

    @property
    def server_args(self) -> list[str]:
        media = ["--media-io-kwargs", _json(self.media_io)] if self.media_io else []
        return [*self.vllm_args, *media]


def _json(obj: object) -> str:
    return json.dumps(obj)


GROUPS = {
    "llava": Group("llava", SPECS["tiny"]),
    # items of 6.3 to 125.8 MB, four at once: buffers of 1 GiB on every path
    "qwen3": Group("qwen3", video.SPEC, tuple(video.VLLM_ARGS), video.MEDIA_IO,
                   video.GATEWAY, 1 << 30),
}


@dataclass
class ProbedServer(VllmServer):
    """`vllm serve` through probe.py; without `guard`, as vLLM ships (no middleware)."""

    guard: bool = True

    def command(self) -> list[str]:
        cmd = [PROBE if c == "encoder_service.local.vllm_cli" else c
               for c in super().command()]
        if not self.guard:
            i = cmd.index("--middleware")
            del cmd[i:i + 2]
        return cmd


@dataclass
class ProbedPool(PoolServer):
    def command(self) -> list[str]:
        cmd = super().command()
        i = cmd.index("encoder_service.encoder_pool.server")
        return [*cmd[:i], PROBE, "pool", *cmd[i + 1:]]


def probe_env(probe_dir: Path) -> dict[str, str]:
    return {PROBE_ENV: str(probe_dir), **pythonpath_env()}


def _probed(server: ManagedProcess, probe_dir: Path) -> ManagedProcess:
    """The same server (an `epd up` plan's) started through the probe."""
    cls = ProbedServer if isinstance(server, VllmServer) else ProbedPool
    kw = {f.name: getattr(server, f.name) for f in fields(server)}  # type: ignore[arg-type]
    kw["env"] = {**kw["env"], **probe_env(probe_dir)}
    return cls(**kw)


def _pids(**procs: ManagedProcess) -> dict[str, int]:
    """CpuMeter's servers: name -> root pid."""
    out = {}
    for name, p in procs.items():
        assert p.proc is not None
        out[name] = p.proc.pid
    return out


def _stopper(*procs: ManagedProcess | None, after=None) -> Callable[[], None]:
    def stop() -> None:
        for p in procs:
            if p is not None:
                p.stop()
        if after is not None:
            after()

    return stop


def _vllm(name: str, g: Group, model: Path, port: int, work: Path, probe_dir: Path,
          ec: dict | None, core: int | None, env: dict | None = None,
          args: list[str] | None = None) -> ProbedServer:
    return ProbedServer(name, model, port, work, ec, cpu_core=core, served_name=g.served,
                        extra_args=[*g.server_args, *(args or [])],
                        env={**(env or {}), **probe_env(probe_dir)}, guard=False)


def start_aggregated(g: Group, model: Path, work: Path, probe_dir: Path, say) -> Stack:
    s = _vllm("rv-aggregated", g, model, BASE_PORT + 1, work, probe_dir, None, None)
    start_all([s], progress=say)
    return Stack("aggregated", g.served, s.url, s.stop, pids=_pids(decode=s),
                 probe_dir=probe_dir)


def _pair(name: str, g: Group, model: Path, work: Path, probe_dir: Path, say,
          cfg: Callable[[str], dict], env: dict | None = None
          ) -> tuple[ProbedServer, ProbedServer]:
    enc = _vllm(f"rv-{name}-encoder", g, model, BASE_PORT + 1, work, probe_dir,
                cfg("ec_producer"), 0, env)
    dec = _vllm(f"rv-{name}-decode", g, model, BASE_PORT + 2, work, probe_dir,
                cfg("ec_consumer"), 1, env)
    start_all([enc, dec], progress=say)
    return enc, dec


def start_example(g: Group, model: Path, work: Path, probe_dir: Path, say) -> Stack:
    storage = Path(tempfile.mkdtemp(prefix="epd-rivals-example-", dir="/dev/shm"))

    def rm() -> None:
        shutil.rmtree(storage, ignore_errors=True)

    try:
        enc, dec = _pair("example", g, model, work, probe_dir, say,
                         lambda role: example_config(role, storage))
    except BaseException:
        rm()
        raise
    try:
        gw = start_gateway("rv-example-gateway", BASE_PORT, work, model=g.served,
                           encoders=[enc.url], decoders=[dec.url],
                           config={**g.gateway, "routing": gateway_routing(
                               {"overlap": "off", **g.gateway.get("routing", {})},
                               list(g.vllm_args))})
    except BaseException:
        _stopper(enc, dec, after=rm)()
        raise
    return Stack("ec_example", g.served, gw.url, _stopper(gw, enc, dec, after=rm),
                 pids=_pids(decode=dec, encoder=enc, front=gw), probe_dir=probe_dir)


def mooncake_config(role: str, port: int, buffer_bytes: int) -> dict:
    """vLLM's ECMooncakeConnector on this host: cpu buffers, the engine over TCP; `port`
    is the instance's control port (a consumer listens there for reservations)."""
    return {"ec_connector": "ECMooncakeConnector", "ec_role": role, "ec_buffer_device": "cpu",
            "ec_buffer_size": buffer_bytes, "ec_ip": "127.0.0.1", "ec_port": port,
            "ec_connector_extra_config": {"mooncake_protocol": "tcp"}}


# the engine advertises vLLM's get_ip() (the machine's other address unless this is set);
# the V1 runner drives the connector on empty steps as the V2 runner does (probe.py)
MOONCAKE_ENV = {"VLLM_HOST_IP": "127.0.0.1", "MC_TCP_BIND_ADDRESS": "127.0.0.1",
                V1_NO_FORWARD_ENV: "1"}


def start_mooncake(g: Group, model: Path, work: Path, probe_dir: Path, say) -> Stack:
    ports = {"ec_producer": BASE_PORT + 61, "ec_consumer": BASE_PORT + 60}
    enc, dec = _pair("mooncake", g, model, work, probe_dir, say,
                     lambda role: mooncake_config(role, ports[role], g.buffer_bytes),
                     MOONCAKE_ENV)
    front = mooncake_front.process(
        "rv-mooncake-front", BASE_PORT, work, encoder=enc.url, model=g.served,
        decoders=[(dec.url, f"tcp://127.0.0.1:{ports['ec_consumer']}")], config=g.gateway)
    try:
        start_all([front], timeout_s=60, progress=say)
    except BaseException:
        _stopper(enc, dec)()
        raise
    return Stack("ec_mooncake", g.served, front.url, _stopper(front, enc, dec),
                 pids=_pids(decode=dec, encoder=enc, front=front), probe_dir=probe_dir)


def start_ours(name: str, g: Group, model: Path, work: Path, probe_dir: Path, say) -> Stack:
    """`epd up`'s plan for `name` (its servers, its gateway's config), each server through
    the probe, the gateway as a process of its own."""
    sizes = {"memory_pool_bytes": g.buffer_bytes, "shm_arena_bytes": g.buffer_bytes,
             "shm_consumer_pool_bytes": g.buffer_bytes}
    transport = {"ours_te": "mooncake", "ours_fs": "safetensors",
                 "ours_nixl": "nixl"}.get(name, "shm")
    epd = name == "ours_epd"  # `epd up --prefill 1 --decode 1`: P and D on core 1 both
    cfg = UpConfig(model=g.spec.name, transport=transport,
                   encoder_backend="pool" if "pool" in name else "vllm",
                   base_port=BASE_PORT, mooncake_base_port=MOONCAKE_BASE_PORT,
                   prefills=1 if epd else 0, decoders=1,
                   cpu_cores=[0, 1, 1] if epd else [0, 1], vllm_args=list(g.vllm_args),
                   media_io_kwargs=g.media_io or {}, gateway=g.gateway,
                   connector_extra=sizes)
    dep = Deployment(cfg, work / name)
    dep.plan(model)
    dep.check_ports()
    enc, dec = (_probed(s, probe_dir) for s in (dep.encoders[0], dep.decoders[0]))
    pre = [_probed(s, probe_dir) for s in dep.prefills]
    start_all([enc, dec, *pre], progress=say)
    assert dep.gateway_cfg is not None
    try:
        config = {**g.gateway, "encoder_backend": cfg.encoder_backend,
                  **{key: getattr(dep.gateway_cfg, key).model_dump(mode="json",
                                                                  exclude_none=True)
                     for key in ("routing", "availability")},  # as `epd up` made them
                  **({"prefills": [p.url for p in pre]} if pre else {})}
        gw = start_gateway(f"rv-{name}-gateway", BASE_PORT, work, model=g.served,
                           encoders=[enc.url], decoders=[dec.url], config=config)
    except BaseException:
        _stopper(enc, dec, *pre)()
        raise
    pids = _pids(decode=dec, encoder=enc, front=gw,
                 **({"prefill": pre[0]} if pre else {}))
    return Stack(name, g.served, gw.url, _stopper(gw, enc, dec, *pre), pids=pids,
                 probe_dir=probe_dir, hop_log=gw.log_path if pre else None)


def nixl_args() -> list[str]:
    """vLLM's P/D proxy's KV connector on this host: NixlConnector, kv_both, cpu buffers
    (vLLM's defaults otherwise; no recompute policy, as vLLM's example runs it)."""
    return ["--kv-transfer-config", _json({"kv_connector": "NixlConnector",
                                           "kv_role": "kv_both", "kv_buffer_device": "cpu"})]


def start_vllm_epd(name: str, g: Group, model: Path, work: Path, probe_dir: Path, say
                   ) -> Stack:
    """vllm_epd (encoder, prefill, decode), vllm_pd_text or vllm_pd_router (prefill,
    decode), each vLLM server plain, epd_front.py (vllm_pd_router: vLLM's router) in front."""
    text = name in TEXT_ONLY
    router = None
    if name == "vllm_pd_router":
        router = router_binary(ROUTER_ENV)
        if router is None:
            raise Unsupported("vllm-router could not be installed (said above)")
    storage = None if text else Path(tempfile.mkdtemp(prefix="epd-rivals-vepd-",
                                                      dir="/dev/shm"))

    def ec(role: str) -> dict | None:
        return None if storage is None else example_config(role, storage)

    def rm() -> None:
        if storage is not None:
            shutil.rmtree(storage, ignore_errors=True)

    enc = None if text else _vllm(f"rv-{name}-encoder", g, model, BASE_PORT + 1, work,
                                  probe_dir, ec("ec_producer"), 0)
    # vLLM's own NIXL agent, as its users run it: our plugin, installed in this venv, would
    # otherwise start it without NIXL's progress thread too (ec_connectors/plugin.py)
    nixl = {"EPD_NIXL_PROGRESS_THREAD": os.environ.get("RIVAL_NIXL_PROGRESS_THREAD", "1")}
    pre = _vllm(f"rv-{name}-prefill", g, model, BASE_PORT + 3, work, probe_dir,
                ec("ec_consumer"), 1,
                {**nixl, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_PORT)},
                nixl_args())
    dec = _vllm(f"rv-{name}-decode", g, model, BASE_PORT + 2, work, probe_dir, None, 1,
                {**nixl, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_PORT + 1)},
                nixl_args())
    servers = [s for s in (enc, pre, dec) if s is not None]
    try:
        start_all(servers, progress=say)
    except BaseException:
        rm()
        raise
    front: ManagedProcess
    if router is not None:  # the router's own P/D flow: prefill, then decode with its KV
        front = RouterProcess(f"rv-{name}-front", BASE_PORT, work, router, [
            "--vllm-pd-disaggregation", "--prefill", pre.url, "--decode", dec.url,
            "--kv-connector", "nixl", "--policy", "round_robin"])
    else:
        front = epd_front.process(f"rv-{name}-front", BASE_PORT, work,
                                  encoder=enc.url if enc else "", prefills=[pre.url],
                                  decodes=[dec.url])
    try:
        start_all([front], timeout_s=60, progress=say)
    except BaseException:
        _stopper(*servers, after=rm)()
        raise
    pids = _pids(decode=dec, prefill=pre, front=front, **({"encoder": enc} if enc else {}))
    return Stack(name, g.served, front.url, _stopper(front, *servers, after=rm), pids=pids,
                 probe_dir=probe_dir, hop_log=None if router else front.log_path,
                 text_only=text)


class Unsupported(RuntimeError):
    """A deployment of ours that cannot serve a model at all (not a failure of the run)."""


def check_supported(name: str, model: Path) -> None:
    if name != "ours_pool_shm":
        return
    from encoder_service.encoder_pool.models import ENCODERS

    archs = json.loads((model / "config.json").read_text()).get("architectures") or []
    if not any(a in ENCODERS for a in archs):
        raise Unsupported(f"the encoder pool has no encoder for {archs} "
                          f"(encoder_service/encoder_pool/models.py: {', '.join(ENCODERS)})")


def start(name: str, group: str, work: Path, models: Path, probe_dir: Path, say) -> Stack:
    """Deployment `name` of model group `group`, started fresh (its probe dir emptied); the
    test models built (once) under `models`."""
    g = GROUPS[group]
    model = build(models / g.served, g.spec)
    check_supported(name, model)
    shutil.rmtree(probe_dir, ignore_errors=True)
    probe_dir.mkdir(parents=True)
    if name == "aggregated":
        return start_aggregated(g, model, work, probe_dir, say)
    if name == "ec_example":
        return start_example(g, model, work, probe_dir, say)
    if name == "ec_mooncake":
        return start_mooncake(g, model, work, probe_dir, say)
    if name in ("ours_shm", "ours_te", "ours_fs", "ours_nixl", "ours_pool_shm", "ours_epd"):
        return start_ours(name, g, model, work, probe_dir, say)
    if name in ("vllm_epd", "vllm_pd_text", "vllm_pd_router"):
        return start_vllm_epd(name, g, model, work, probe_dir, say)
    raise ValueError(f"unknown deployment {name!r}")
