"""vLLM's Rust router (`pip install vllm-router`), a rival front, installed as a user would.

`router_binary(env)` installs it once into a side environment (`ROUTER_ENV` by default) and
gives its executable; `RouterProcess` runs it as a managed process in front of vLLM servers
(one worker list, or vLLM's P/D with its KV connector).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from encoder_service.local.processes import ManagedProcess

ROUTER_ENV = Path(".work/bench-envs/vllm-router")
ROUTER_PACKAGE = "vllm-router"


def router_binary(env: Path) -> Path | None:
    """vllm-router's executable in the side environment `env`, installed there first when it
    is not yet (`python -m venv`, `pip install vllm-router`); None, said on stderr, when it
    cannot be (no network, no such package for this platform)."""
    exe = env / "bin" / "vllm-router"
    if exe.exists():
        return exe
    print(f"installing {ROUTER_PACKAGE} into {env} (once)", file=sys.stderr, flush=True)
    try:
        if not (env / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(env)], check=True,
                           capture_output=True, timeout=300)
        subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q",
                        ROUTER_PACKAGE], check=True, capture_output=True, timeout=900)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        tail = detail.decode(errors="replace").strip().splitlines()[-1:] if detail else []
        print(f"{ROUTER_PACKAGE} could not be installed into {env} ({exc}"
              f"{': ' + tail[0] if tail else ''}): skipped, the other fronts only",
              file=sys.stderr)
        return None
    if not exe.exists():
        print(f"{ROUTER_PACKAGE} installed no `vllm-router` executable into {env}: skipped",
              file=sys.stderr)
        return None
    return exe


@dataclass
class RouterProcess(ManagedProcess):
    """`vllm-router ARGS` on `port` (its Prometheus endpoint on `port + 1`), log in
    work_dir/logs; healthy once its `/health` answers."""

    name: str
    port: int
    work_dir: Path
    exe: Path = Path("vllm-router")
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [str(self.exe), "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(self.port + 1), "--log-level", "warning",
                *self.args]
