"""The gateway's hop beside nginx's and vLLM's router's: the same small chat request sent
straight to a stand-in decode instance, through nginx (`proxy_pass` to an upstream with a
keepalive pool), through vLLM's Rust router (`vllm-router --policy round_robin`), through
`epd gateway --decoder` (no encoders, probes off) and through a bare Python proxy
(gateway/bare_proxy.py: uvloop and httptools, no logic: what any Python hop costs here), one
kept-alive connection each, sequentially; rounds interleaved (direct, nginx, router, gateway,
bare, then rotated). Per stand-in delay: the direct p50, what each front adds (median over
rounds of its round median minus the direct one), the ratio gateway/router and the verdict
against the target (the gateway's hop at most the router's).

nginx comes from the system (Debian's `nginx-light`); where `nginx` is not on PATH it is
skipped with a message. vllm-router is installed from PyPI, as a user would, into a side
environment made once and reused (`--router-env`, by default `.work/bench-envs/vllm-router`);
where it cannot be installed (no network) the benchmark says so and runs the rest.

    python -m benchmarks.gateway.hop [--delays-ms 0 20] [--rounds 5] [--requests 200]
                                     [--router-env DIR | --no-router]

`--also-gateway DIR [DIR ...]` adds other checkouts' gateways (each `DIR` holds its
`encoder_service`, e.g. `git archive HEAD encoder_service | tar -x -C DIR`) as the fronts
`gw:<DIR's name>`: a change A/B in the same interleaved rounds.

`--layers` adds two fronts to the rounds, the gateway's layers one by one on the bare proxy
(bare_proxy.py's modes): `http1` (the bare front relaying through the gateway's upstream
client) and `uvicorn` (uvicorn as the gateway runs it, a raw ASGI app, that client); what the
gateway adds above `uvicorn` is its own request path (admission, the chat flow, the relay,
metrics, the log line).

On a shared machine: `flock /tmp/epd-vllm.lock python -m benchmarks.gateway.hop`."""

from __future__ import annotations

import argparse
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from benchmarks.harness.env import pythonpath_env
from benchmarks.harness.processes import GatewayProcess, StandIn, start_gateway
from benchmarks.harness.router import ROUTER_ENV, RouterProcess, router_binary

PORT = 20990  # stand-in 20990, nginx 20991, gateway 20992, bare proxy 20993, layers 20994-5,
#               vllm-router 20997 (its Prometheus port 20998), --also-gateway 21000 on
LAYERS = ("http1", "uvicorn")  # bare_proxy.py's modes, with --layers
MODEL = "stand-in"
TARGET = 1.0  # the gateway may add at most this many times what vllm-router adds


class KeepAliveClient:
    """One kept-alive HTTP/1.1 connection with a blocking socket: as little client time as
    possible around each request, the same for every front."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._connect()

    def _connect(self) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def ready(self) -> None:
        """Reconnect when the server closed the idle connection meanwhile (uvicorn's
        keep-alive timeout is shorter than another front's turn at 20 ms per request)."""
        if select.select([self.sock], [], [], 0)[0]:
            self.sock.close()
            self._connect()

    def close(self) -> None:
        self.sock.close()

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data

    def post(self, request: bytes) -> bytes:
        """Send one whole request, return the answer's body (checked: 200)."""
        self.sock.sendall(request)
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip()
                   for k, v in (ln.split(b":", 1) for ln in lines[1:])}
        if b"content-length" in headers:
            n = int(headers[b"content-length"])
            while len(self.buf) < n:
                self._fill()
            body, self.buf = self.buf[:n], self.buf[n:]
        else:  # chunked
            body = b""
            while True:
                while b"\r\n" not in self.buf:
                    self._fill()
                size_line, rest = self.buf.split(b"\r\n", 1)
                n = int(size_line.split(b";")[0], 16)
                while len(rest) < n + 2:
                    self._fill()
                    rest = self.buf.split(b"\r\n", 1)[1]
                body += rest[:n]
                self.buf = rest[n + 2:]
                if n == 0:
                    break
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
        return body


def chat_request(port: int) -> bytes:
    body = msgspec.json.encode({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "Say ok."}]})
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (port, len(body))) + body


NGINX_CONF = """\
worker_processes 1;
daemon off;
master_process off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream stand_in {{
        server 127.0.0.1:{upstream};
        keepalive 16;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://stand_in;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""


class Nginx:
    """nginx in the foreground (one process, no master), its config, pid, logs and temp
    paths in a directory of its own."""

    def __init__(self, nginx: str, port: int, upstream: int, work: Path) -> None:
        self.dir = work / "nginx"
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=self.dir, port=port, upstream=upstream))
        self.proc = subprocess.Popen([nginx, "-p", str(self.dir), "-c", str(conf),
                                      "-e", str(self.dir / "error.log")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_listening(port, self.proc)
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"nginx: {exc}: {self.proc.stderr.read().decode()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class OtherGateway(GatewayProcess):
    """`epd gateway` imported from another checkout (`source`: the directory holding its
    `encoder_service`), with this one's arguments."""

    source: Path = Path()

    def command(self) -> list[str]:
        cmd = super().command()
        boot = (f"import runpy, sys; sys.path.insert(0, {str(self.source)!r}); "
                "runpy.run_module('encoder_service.cli', run_name='__main__')")
        return [cmd[0], "-c", boot, *cmd[3:]]


class Router:
    """vLLM's Rust router in front of the stand-in, round robin over its one worker
    (harness/router.py's process: its Prometheus endpoint on the next port, its log in
    work/logs); ready once its port listens, as the other fronts here."""

    def __init__(self, exe: Path, port: int, upstream: int, work: Path) -> None:
        self.server = RouterProcess("vllm-router", port, work, exe, [
            "--worker-urls", f"http://127.0.0.1:{upstream}", "--policy", "round_robin"])
        self.server.start()
        assert self.server.proc is not None
        try:
            wait_listening(port, self.server.proc, timeout_s=60)
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"vllm-router: {exc}: see {self.server.log_path}") from None

    def stop(self) -> None:
        self.server.stop(timeout_s=5)


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the front for port {port} exited ({proc.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def measure(ports: dict[str, int], rounds: int, requests: int, warmup: int) -> dict:
    """{front: [round median seconds]}; rounds rotate the fronts' order."""
    names = list(ports)
    clients = {n: KeepAliveClient(p) for n, p in ports.items()}
    reqs = {n: chat_request(p) for n, p in ports.items()}
    out: dict[str, list[float]] = {n: [] for n in names}
    try:
        for n in names:
            for _ in range(warmup):
                clients[n].post(reqs[n])
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                c, req, times = clients[n], reqs[n], []
                c.ready()
                for i in range(requests):
                    t = time.perf_counter()
                    try:
                        c.post(req)
                    except (OSError, RuntimeError) as exc:
                        raise RuntimeError(f"{n}, round {r}, request {i}: {exc}") from exc
                    times.append(time.perf_counter() - t)
                out[n].append(statistics.median(times))
    finally:
        for c in clients.values():
            c.close()
    return out


def summarize(delay_ms: float, rounds: dict[str, list[float]]) -> dict:
    direct = rounds["direct"]
    row: dict = {"delay_ms": delay_ms, "direct_p50_ms": statistics.median(direct) * 1e3}
    others = [f for f in rounds if f.startswith("gw:")]
    for front in ("nginx", "router", "gateway", "bare", *LAYERS, *others):
        if front in rounds:
            row[f"{front}_added_ms"] = statistics.median(
                f - d for f, d in zip(rounds[front], direct, strict=True)) * 1e3
    if "router_added_ms" in row:
        row["ratio"] = row["gateway_added_ms"] / max(row["router_added_ms"], 1e-6)
    return row


def format_rows(rows: list[dict], rounds: int, requests: int) -> str:
    lines = [f"gateway hop beside nginx and vllm-router ({rounds} rounds x {requests} "
             "requests, medians; added = round median minus direct's)",
             f"{'stand-in delay':>14} {'direct p50':>11} {'nginx +':>9} {'router +':>9} "
             f"{'gateway +':>10} {'bare py +':>10} {'gw/router':>10}  verdict"]

    def added(r: dict, front: str) -> str:
        return f"{r[front + '_added_ms']:.3f}" if front + "_added_ms" in r else "-"

    for r in rows:
        if "ratio" in r:
            ratio = f"{r['ratio']:.2f}x"
            verdict = "at or below the router" if r["ratio"] <= TARGET else "above the router"
        else:
            ratio, verdict = "-", "no router to compare"
        layers = "".join(f"  {m[:-9]} +{r[m]:.3f}" for m in r if m.endswith("_added_ms")
                         and (m.startswith("gw:") or m[:-9] in LAYERS))
        lines.append(f"{r['delay_ms']:>11g} ms {r['direct_p50_ms']:>8.3f} ms "
                     f"{added(r, 'nginx'):>9} {added(r, 'router'):>9} "
                     f"{r['gateway_added_ms']:>10.3f} {added(r, 'bare'):>10} {ratio:>10}  "
                     f"{verdict}{layers}")
    return "\n".join(lines)


def run_delay(delay_ms: float, a: argparse.Namespace, nginx: str | None, router: Path | None,
              work: Path) -> dict:
    stand_in = StandIn("stand-in", a.port, work, delay_ms=delay_ms).start()
    front: Nginx | None = None
    rt: Router | None = None
    gw: GatewayProcess | None = None
    others: list[GatewayProcess] = []
    bare: list[subprocess.Popen] = []
    try:
        stand_in.wait(30)
        ports = {"direct": a.port}
        if nginx is not None:
            front = Nginx(nginx, a.port + 1, a.port, work)
            ports["nginx"] = a.port + 1
        if router is not None:
            rt = Router(router, a.port + 7, a.port, work)
            ports["router"] = a.port + 7
        gw = start_gateway("gateway", a.port + 2, work, model=MODEL, decoders=[stand_in.url],
                           config={"routing": {"probe_interval_s": 0}})
        ports["gateway"] = a.port + 2
        for i, source in enumerate(a.also_gateway):
            name = f"gw:{source.resolve().name}"
            others.append(OtherGateway(name.replace(":", "-"), a.port + 10 + i, work, MODEL,
                                       decoders=[stand_in.url],
                                       config={"routing": {"probe_interval_s": 0}},
                                       source=source.resolve()).start())
            others[-1].wait()
            ports[name] = a.port + 10 + i
        for i, mode in enumerate(("bare", *LAYERS) if a.layers else ("bare",)):
            port = a.port + 3 + i
            bare.append(subprocess.Popen([sys.executable, "-m", "benchmarks.gateway.bare_proxy",
                                          str(port), str(a.port), mode],
                                         env={**os.environ, **pythonpath_env()}))
            wait_listening(port, bare[-1])
            ports[mode] = port
        return summarize(delay_ms, measure(ports, a.rounds, a.requests, a.warmup))
    finally:
        for proc in bare:
            proc.terminate()
            proc.wait(timeout=10)
        if gw is not None:
            gw.stop()
        for other in others:
            other.stop()
        if front is not None:
            front.stop()
        if rt is not None:
            rt.stop()
        stand_in.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 20.0],
                   help="the stand-in answers after this long (each a run of its own)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=200, help="per front and round")
    p.add_argument("--warmup", type=int, default=50, help="per front, before the rounds")
    p.add_argument("--port", type=int, default=PORT,
                   help="the stand-in's; nginx the next, the gateway the one after, "
                   "vllm-router the seventh after")
    p.add_argument("--layers", action="store_true",
                   help="also the gateway's layers on the bare proxy (http1, uvicorn)")
    p.add_argument("--router-env", type=Path, default=ROUTER_ENV,
                   help="the side environment vllm-router is installed into (once)")
    p.add_argument("--no-router", action="store_true", help="leave vllm-router out")
    p.add_argument("--also-gateway", type=Path, metavar="DIR", nargs="+", default=[],
                   help="other checkouts' gateways beside this one's (fronts gw:<name>)")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    a = p.parse_args()
    nginx = shutil.which("nginx")
    if nginx is None:
        print("nginx is not on PATH: skipped (Debian: apt-get install nginx-light)",
              file=sys.stderr)
    router = None if a.no_router else router_binary(a.router_env)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gw-hop-") as tmp:
        for delay in a.delays_ms:
            rows.append(run_delay(delay, a, nginx, router, Path(tmp)))
            print(format_rows(rows[-1:], a.rounds, a.requests).splitlines()[-1],
                  file=sys.stderr, flush=True)
    print(format_rows(rows, a.rounds, a.requests))
    if a.json:
        print(msgspec.json.encode(rows).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
