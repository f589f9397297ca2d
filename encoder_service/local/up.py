"""`epd up`: a whole local EPD deployment, its processes.

`Deployment` turns an `UpConfig` (up_config.py: the transports and the connector keys they
imply) into servers: the encoder(s) (vLLM ec_producer, or `epd encoder` batching pools with
`encoder_backend = "pool"`), the prefill/decode instance(s) (vLLM ec_consumer; E/P/D with
`prefills`: decode and prefill instances, ec_consumers with vLLM's NixlConnector:
kv_transfer_config), the Mooncake Store master where a store tier is used, and the gateway.
Keys: with a deployment secret (`secret_file`, else $EPD_SECRET_FILE) every vLLM server and
encoder pool requires the API key derived from it (passed in $VLLM_API_KEY, never on a command
line) and the gateway presents it; without one they take no key and listen on 127.0.0.1 only, as
the data plane does (said at start). Gateway clients need a key when `gateway` sets api_keys /
api_keys_file or $EPD_GATEWAY_API_KEY is set (said at start too). `run_up` waits for health with
progress output, then serves the gateway in-process and prints the endpoint, then supervises: a
server or the store master that exits unasked is restarted with backoff, the gateway told
(supervise.py). Ctrl-C or SIGTERM stops everything: the gateway, then every server's whole
session (SIGTERM, then SIGKILL after a grace period; also of one that died), the store master
last, so no process is left behind. A SIGKILL of `epd up` itself cannot be handled; its servers
then get their parent-death signal and go too (`epd_common.child_process`: they are started from
the main thread, which lives as long as `epd up`). The command line: up_cli.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ec_connectors.config import ConfigError, EPDConfig
from ec_connectors.protocol import ports
from ec_connectors.protocol.api_keys import API_KEY_ENV, api_key
from ec_connectors.protocol.secret_file import SECRET_ENV, SecretError, read_secret
from encoder_service.gateway.auth import upstream_headers
from encoder_service.gateway.config import GatewayConfig, GatewayConfigError
from encoder_service.local.mooncake_master import MasterServer, master_server
from encoder_service.local.processes import (
    ManagedProcess,
    PoolServer,
    ServerFailed,
    VllmServer,
    start_all,
)
from encoder_service.local.scaler import Scaler
from encoder_service.local.supervise import supervise
from encoder_service.local.up_config import (
    UpConfig,
    UpError,
    connector_extra,
    gateway_routing,
    kv_side_channel_port,
    kv_transfer_config,
    mooncake_endpoint,
)
from epd_common.net import port_holder

DECODE_ARGS = ["--enable-scale-out"]  # vLLM flags every decode instance gets


def epd_config(role: str, storage: Path, extra: dict[str, Any] | None = None) -> dict:
    """A vLLM server's --ec-transfer-config.

    One vLLM server's --ec-transfer-config: EPDConnector as `role`, over the shared
    directory `storage` unless `extra` (connector_extra's keys) says otherwise."""
    return {"ec_connector": "EPDConnector", "ec_role": role, "ec_buffer_device": "cpu",
            "ec_connector_extra_config": {"transport": "safetensors",
                                          "storage_path": str(storage), **(extra or {})}}


@dataclass
class Deployment:
    """The started servers and gateway; `stop()` is idempotent and safe from any state."""

    cfg: UpConfig
    work_dir: Path
    encoders: list[ManagedProcess] = field(default_factory=list)  # VllmServer or PoolServer
    decoders: list[VllmServer] = field(default_factory=list)
    prefills: list[VllmServer] = field(default_factory=list)  # E/P/D (cfg.prefills)
    # elastic roles (cfg.scaling): the instances planned beyond the minimum, ports known; the
    # scaler (scaler.py) starts and stops them, stop() stops those running
    spare: list[ManagedProcess] = field(default_factory=list)
    master: MasterServer | None = None  # the Mooncake Store master (mooncake_store, tiered)
    gateway: Any = None  # GatewayThread
    gateway_cfg: GatewayConfig | None = None
    engine_ports: tuple[str, str] | None = None  # MC_MIN/MAX_RPC_PORT of every Mooncake process

    @property
    def servers(self) -> list[ManagedProcess]:
        return [*self.encoders, *self.decoders, *self.prefills]

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.base_port}"

    def plan(self, model: Path) -> None:
        cfg = self.cfg
        logs = self.work_dir / "up"
        storage = Path(cfg.storage_path or logs / "ec-cache")
        if cfg.clear_cache:
            shutil.rmtree(storage, ignore_errors=True)
        storage.mkdir(parents=True, exist_ok=True)
        ncpu = os.cpu_count() or 1
        cores = list(cfg.cpu_cores or [])
        n = cfg.servers
        if cores and len(cores) < n:
            raise UpError(f"cpu_cores lists {len(cores)} cores for {n} vLLM servers (elastic "
                          "roles count at their maximum)")
        port = cfg.base_port + 1
        mooncake = cfg.uses_te or cfg.uses_store
        env = self.mooncake_env() if mooncake else {}
        if cfg.uses_store:
            self.master = master_server(logs, cfg.master_port)
            self.master.env = dict(env)
        try:
            secret = read_secret(cfg.secret_path)
        except SecretError as exc:
            raise UpError(str(exc)) from None
        # Every server's key, in its environment (never argv: `ps` shows that); without a
        # secret an inherited $VLLM_API_KEY is cleared, as the gateway could not present it.
        env[API_KEY_ENV] = "" if secret is None else api_key(secret)
        if secret is not None:
            env[SECRET_ENV] = str(cfg.secret_path)
        media = {"media_io_kwargs": cfg.media_io_kwargs} if cfg.media_io_kwargs else {}
        media_args = (["--media-io-kwargs", json.dumps(cfg.media_io_kwargs)]
                      if cfg.media_io_kwargs else []) + self.trace_args  # and tracing
        for i in range(n):
            core = cores[i] if cores else i % ncpu
            if i < cfg.planned_encoders:
                extra = connector_extra(cfg, "ec_producer", i)
                if cfg.encoder_backend == "pool":
                    self.encoders.append(PoolServer(
                        f"encoder-{i}", model, port + i, logs, cpu_core=core,
                        served_name=cfg.served_model_name, env=dict(env), pool_config={
                            **media, **cfg.pool,
                            "transport": {"storage_path": str(storage), **extra}}))
                    continue
                s = VllmServer(f"encoder-{i}", model, port + i, logs,
                               epd_config("ec_producer", storage, extra), cpu_core=core,
                               served_name=cfg.served_model_name,
                               extra_args=list(cfg.vllm_args) + media_args,
                               env={**env, **self.trace_env(f"encoder-{i}")},
                               fork_server=cfg.fork_server)
                self.encoders.append(s)
            else:
                self._lm_server(i - cfg.planned_encoders, model, port + i, core, storage, env,
                                media_args)
        self.spare = [*self.encoders[cfg.encoders:], *self.decoders[cfg.decoders:]]
        del self.encoders[cfg.encoders:], self.decoders[cfg.decoders:]
        for extra in ({"storage_path": str(storage), **connector_extra(cfg, "ec_producer")},
                      connector_extra(cfg, "ec_consumer")):
            try:  # fail now, not after minutes of vLLM start-up
                EPDConfig.from_dict({"transport": "safetensors", **extra})
            except ConfigError as exc:
                raise UpError(f"connector_extra: {exc}") from None
        # What the gateway can know is already encoded: the TE producers' announcements, else
        # the shared directory or the shm records; the store has no catalog to follow
        # (encoders skip the encode of an item the store holds, the gateway cannot tell).
        availability: dict[str, Any] = {"kind": "none"}
        if cfg.uses_te and self.mooncake_producers:
            availability = {"kind": "mooncake", "producers": self.mooncake_producers}
        elif "safetensors" in cfg.tiers:
            availability = {"kind": "safetensors", "storage_path": str(storage)}
        elif "shm" in cfg.tiers:  # the gateway runs on this host too
            availability = {"kind": "shm", "shm_path": cfg.shm_path}
        tracing = ({"tracing": {"otlp_traces_endpoint": cfg.otlp_traces_endpoint,
                                **cfg.gateway.get("tracing", {})}}
                   if cfg.otlp_traces_endpoint else {})
        routing = gateway_routing(cfg.gateway.get("routing"), cfg.vllm_args)
        try:
            self.gateway_cfg = GatewayConfig.build({
                **cfg.gateway, **tracing, "routing": routing,
                **({"secret_file": cfg.secret_path} if secret else {}),
                "host": cfg.host, "port": cfg.base_port,
                "model": cfg.served_model_name, "encoders": [s.url for s in self.encoders],
                "encoder_backend": cfg.encoder_backend,
                "decoders": [s.url for s in self.decoders],
                "prefills": [s.url for s in self.prefills], "availability": availability})
        except GatewayConfigError as exc:
            raise UpError(str(exc)) from None

    def _lm_server(self, j: int, model: Path, port: int, core: int, storage: Path,
                   env: dict[str, str], media_args: list[str]) -> None:
        """The name, port and role of language-model instance j.

        Language-model instance j: decode instances, then (E/P/D) prefill instances;
        with prefill instances all of them get the KV connector and a side channel."""
        cfg = self.cfg
        prefill = j >= cfg.planned_decoders
        name = f"prefill-{j - cfg.planned_decoders}" if prefill else f"decode-{j}"
        # decode instances serve vLLM's token-in API (render + generate): the gateway
        # continues a broken stream there token for token (gateway/failover.py)
        args = list(cfg.vllm_args) + media_args + ([] if prefill else DECODE_ARGS)
        env = {**env, **self.trace_env(name)}
        if cfg.prefills:  # E/P/D: the KV connector and its side channel
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config(cfg, prefill))]
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(kv_side_channel_port(cfg, j))
        s = VllmServer(name, model, port, self.work_dir / "up",
                       epd_config("ec_consumer", storage, connector_extra(cfg, "ec_consumer")),
                       cpu_core=core, served_name=cfg.served_model_name, extra_args=args,
                       env=env, fork_server=cfg.fork_server)
        (self.prefills if prefill else self.decoders).append(s)

    @property
    def trace_args(self) -> list[str]:
        """Every vLLM server's tracing flag (`otlp_traces_endpoint`; none when off)."""
        url = self.cfg.otlp_traces_endpoint
        return ["--otlp-traces-endpoint", url] if url else []

    def trace_env(self, name: str) -> dict[str, str]:
        """A vLLM server's tracing environment.

        A vLLM server's tracing environment: OTLP over HTTP (vLLM's default is gRPC), its
        service name (epd-encoder-0, epd-decode-0, ...)."""
        if not self.cfg.otlp_traces_endpoint:
            return {}
        return {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_SERVICE_NAME": f"epd-{name}"}

    def mooncake_env(self) -> dict[str, str]:
        """The environment every Mooncake process gets.

        What every Mooncake process gets: loopback, and the range its engines' own
        listeners take ports from (the port plan's, or the user's own when clear of every
        fixed port; refused naming the collisions when not)."""
        try:
            engine = ports.engine_env(self.cfg.fixed_ports, os.environ)
        except ValueError as exc:
            raise UpError(str(exc)) from None
        self.engine_ports = (engine[ports.ENGINE_MIN_ENV], engine[ports.ENGINE_MAX_ENV])
        # NIXL's UCX: only loopback's interface (every server of `epd up` runs on this host)
        ucx = {"UCX_NET_DEVICES": "lo"} if "nixl" in self.cfg.tiers else {}
        return {"MC_TCP_BIND_ADDRESS": "127.0.0.1", **ucx, **engine}

    def trust_lines(self) -> list[str]:
        """What `epd up` says about keys and listeners at start (never a key itself)."""
        cfg, gw = self.cfg, self.gateway_cfg
        assert gw is not None
        if cfg.secret_path and read_secret(cfg.secret_path) is not None:
            servers = (f"deployment secret {cfg.secret_path}: every vLLM server and encoder "
                       "requires the API key derived from it (in $VLLM_API_KEY; `epd api-key` "
                       "prints it) and the gateway presents it")
        else:
            servers = ("no deployment secret (secret_file or $EPD_SECRET_FILE): the vLLM "
                       "servers, encoders and data plane listen on 127.0.0.1 only and take no "
                       "API key")
        n = len(gw.client_api_keys)
        clients = (f"gateway clients must send `Authorization: Bearer <key>` ({n} key(s))"
                   if n else f"gateway: no client API key, anyone who reaches {self.url} can "
                   "use it; set gateway.api_keys_file (one key per line) or gateway.api_keys "
                   "in the config, or $EPD_GATEWAY_API_KEY")
        lines = [servers, clients]
        engines = [name for name, used in (
            ("Transfer Engine", "mooncake" in cfg.tiers and not EPDConfig.from_dict(
                connector_extra(cfg, "ec_consumer")).te_socket),
            ("Store clients", cfg.uses_store)) if used]
        if engines and self.engine_ports:  # Mooncake cannot be told their address
            master = (f", as the Store master's HTTP metadata server "
                      f"(:{ports.master_http_port(cfg.master_port)}) "
                      "does" if cfg.uses_store else "")
            lines.append(f"the Mooncake engines' own listeners ({' and '.join(engines)}: "
                         "two per process, random ports in "
                         f"{'-'.join(self.engine_ports)}, the port plan) bind every "
                         f"interface{master}: firewall them on a shared host (docs/trust.md)")
        return lines

    @property
    def mooncake_producers(self) -> list[str]:
        return [mooncake_endpoint(self.cfg, i) for i in range(self.cfg.encoders)]

    def check_ports(self) -> None:
        """Fail fast (before minutes of vLLM start-up) when a port is taken."""
        wanted = [(self.cfg.host, self.cfg.base_port, "base_port"),
                  *(("127.0.0.1", s.port, "base_port") for s in [*self.servers, *self.spare])]
        if self.cfg.uses_te:
            for i in range(self.cfg.encoders):
                port = ports.encoder_base_port(self.cfg.mooncake_base_port, i)
                wanted += [("127.0.0.1", p, "mooncake_base_port")
                           for p in (port, ports.announce_port(port), ports.stream_port(port))]
        if self.master is not None:
            m = self.master
            wanted += [(m.host, p, "master_port") for p in (m.port, m.http_port, m.metrics_port)]
        seen: dict[int, str] = {}
        for _, port, key in wanted:
            if port in seen and seen[port] != key:
                raise UpError(f"port {port} is both a {seen[port]} port and a {key} port; "
                              f"move one of them")
            seen[port] = key
        for host, port, key in wanted:
            with socket.socket() as sock:
                # as the servers themselves bind (uvicorn, ZMQ): TIME_WAIT leftovers of a
                # previous run are no conflict, a listener is
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((host, port))
                except OSError as exc:
                    held = port_holder(port)
                    raise UpError(f"port {port} on {host} is not free ({exc})"
                                  f"{f', held by {held}' if held else ''}; pick another "
                                  f"{key}") from None

    def start(self, progress=print) -> None:
        from encoder_service.gateway.server import GatewayThread

        if self.master is not None:  # first: every store client connects to it at start-up
            m = self.master
            progress(f"starting {m.name} on :{m.port} (metadata :{m.http_port}, metrics "
                     f":{m.metrics_port}; log {m.log_path})")
            t0 = time.monotonic()
            m.start()
            m.wait()
            progress(f"{m.name} healthy after {time.monotonic() - t0:.1f} s (store_master "
                     f"{m.address}, store_metadata {m.metadata_url})")
        for s in self.spare:  # their fork servers import beside the deploy: scale-ups fork
            s.prepare()
        start_all(self.servers, timeout_s=self.cfg.startup_timeout_s, progress=progress)
        assert self.gateway_cfg is not None
        self.gateway = GatewayThread(self.gateway_cfg).start()
        progress(f"gateway listening on {self.url}")

    def stop(self, progress=print) -> None:
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        alive = [s for s in [*self.servers, *self.spare] if s.running]
        if alive:
            progress(f"stopping {', '.join(s.name for s in alive)}")
        # in parallel; every server's session, also of one that died (what it left) or one
        # an elastic role started and drained
        threads = [threading.Thread(target=s.stop) for s in [*self.servers, *self.spare]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        m = self.master  # last: the servers' store clients unmount their segments from it
        if m is not None:
            if m.running:
                progress(f"stopping {m.name}")
            m.stop()


class _Shutdown(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM handlers."""


def _raise_shutdown(signum: int, frame: object) -> None:
    # once: a second signal (a session's stop signals the group and each member; a second
    # Ctrl-C) must not raise again while the first one's shutdown runs
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _ignore)
    raise _Shutdown(signal.Signals(signum).name)


def _ignore(signum: int, frame: object) -> None:
    print("[up] already stopping; please wait", flush=True)


def run_up(cfg: UpConfig, work_dir: Path,
           demo: Callable[[Deployment], int] | None = None) -> int:
    """Start everything, then serve until a signal (or run `demo(deployment)` and stop).

    Call it from the main thread: the servers die with the thread that started them."""
    from encoder_service.local.testmodels import build

    def say(msg: str) -> None:
        print(f"[up] {msg}", flush=True)

    old = {s: signal.signal(s, _raise_shutdown) for s in (signal.SIGINT, signal.SIGTERM)}
    dep = Deployment(cfg, work_dir)
    try:
        spec = cfg.spec
        model = (build(work_dir / "models" / spec.model_name, spec) if spec is not None
                 else Path(cfg.model))
        dep.plan(model)
        dep.check_ports()
        kind = "epd encoder pool" if cfg.encoder_backend == "pool" else "vLLM"
        chosen, why = cfg.transport_choice
        if cfg.transport == "auto":
            say(f"transport auto -> {chosen}: {why}")
        over = (chosen if len(cfg.tiers) == 1 else
                f"tiers {', '.join(cfg.tiers)}")
        lm = (f"{cfg.prefills} prefill and {cfg.decoders} decode instance(s) (KV handed over "
              f"by {kv_transfer_config(cfg, True)['kv_connector']})" if cfg.prefills
              else f"{cfg.decoders} prefill/decode instance(s)")
        say(f"starting {cfg.encoders} encoder(s) ({kind}) and {lm} of "
            f"{cfg.served_model_name} (EPDConnector over {over})")
        for line in dep.trust_lines():
            say(line)
        dep.start(progress=say)
        say(f"ready: OpenAI-compatible endpoint {dep.url}/v1 (model {cfg.served_model_name!r}); "
            f"metrics {dep.url}/metrics; logs {work_dir / 'up'}")
        if demo is not None:
            return demo(dep)
        say("serving; Ctrl-C or SIGTERM stops everything; " + (
            "what exits unasked is restarted (supervise.py)" if cfg.restart.enabled
            else "restarts are off"))
        supervisor = supervise(dep, cfg.restart, cfg.startup_timeout_s, say)
        from encoder_service.gateway.server import ScalingPort

        scaler = Scaler.of(  # None: every role fixed
            cfg, {"encoder": dep.encoders, "decode": dep.decoders}, dep.spare,
            ScalingPort(dep.gateway), supervisor, say, upstream_headers(cfg.secret_path))
        while True:  # on this thread: restarted (and added) servers die with it
            supervisor.poll()
            if scaler is not None:
                scaler.poll()
            time.sleep(0.5)
    except _Shutdown as exc:
        say(f"{exc} received")
        return 0
    except (ServerFailed, UpError, GatewayConfigError, RuntimeError) as exc:
        say(f"ERROR: {exc}")
        return 1
    finally:
        for s in old:
            signal.signal(s, _ignore)
        dep.stop(progress=say)
        for s, h in old.items():
            signal.signal(s, h)
        say("stopped")
