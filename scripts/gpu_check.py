#!/usr/bin/env python3
"""The GPU check (`./run.sh gpu-check`): this project's CUDA paths on an NVIDIA machine with
PyTorch but no network and no vLLM, in one call of at most 8 minutes. Standard library only.

    ./run.sh gpu-wheels   (here, with the network) this package as a wheel plus the runtime
                          dependencies the CUDA tests need beyond PyTorch, for Python 3.12
                          x86_64, into .work/gpu-wheels (at most 60 MiB: checked)
    ./run.sh gpu-check    (there) a virtualenv over the machine's PyTorch (system site
                          packages) with those wheels, installed offline; then the CUDA tests
                          (tests/ec_connectors/transports/test_memory.py: the device pool and
                          its typed views, pinned and pageable host copies of device tensors)
                          and benchmarks/transports/gpu_path.py (device <-> host copies, pinned and
                          registered, the shm transport with device ends); one summary.

Where `python3` (or $EPD_GPU_PYTHON) has no PyTorch with a CUDA device it says "no GPU" and
exits 0. NIXL's VRAM registration is not covered: the nixl-cu12 wheel alone is 68 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("EPD_WORK_DIR", ROOT / ".work"))
WHEELS = WORK / "gpu-wheels"
VENV = WORK / "gpu-check" / "venv"
LIMIT_BYTES = 60 << 20
BUDGET_S = 8 * 60
TEST_TOOLS = ("pytest", "pytest-timeout", "hypothesis")
CUDA_TESTS = ("tests/ec_connectors/transports/test_memory.py",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "linux_x86_64", "any")


def log(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


def fetch(python_version: str) -> int:
    """Build this package's wheel and download what the CUDA tests need (network)."""
    if WHEELS.exists():
        shutil.rmtree(WHEELS)
    WHEELS.mkdir(parents=True)
    py = sys.executable
    subprocess.run([py, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    str(ROOT), "-w", str(WHEELS)], check=True)
    wheel = next(WHEELS.glob("epd_serve-*.whl"))
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([py, "-m", "pip", "download", "-q", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *plats,
                    "-d", str(WHEELS), str(wheel), *TEST_TOOLS], check=True)
    total = sum(p.stat().st_size for p in WHEELS.iterdir())
    log(f"{len(list(WHEELS.iterdir()))} wheels, {total / 2**20:.1f} MiB in {WHEELS}")
    if total > LIMIT_BYTES:
        log(f"over the {LIMIT_BYTES >> 20} MiB a GPU machine is sent")
        return 1
    return 0


def probe(python: str) -> dict | None:
    code = ("import json, torch; ok = torch.cuda.is_available(); print(json.dumps({"
            "'torch': torch.__version__, 'cuda': torch.version.cuda, 'ok': ok, "
            "'device': torch.cuda.get_device_name(0) if ok else ''}))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def left(t0: float) -> float:
    return max(1.0, BUDGET_S - (time.monotonic() - t0))


def install(python: str, t0: float) -> Path:
    py = VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([python, "-m", "venv", "--system-site-packages", str(VENV)], check=True,
                       timeout=left(t0))
    wheel = sorted(WHEELS.glob("epd_serve-*.whl"))[-1]
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--find-links",
                    str(WHEELS), "--force-reinstall", "--no-deps", str(wheel)], check=True,
                   timeout=left(t0))
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--find-links",
                    str(WHEELS), str(wheel), *TEST_TOOLS], check=True, timeout=left(t0))
    return py


def run_tests(py: Path, t0: float) -> tuple[bool, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([str(py), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "-o", "addopts=", *CUDA_TESTS], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=left(t0))
    lines = [x for x in out.stdout.splitlines() if x.strip()]
    summary = lines[-1] if lines else "(no output)"
    skipped_cuda = [x for x in lines if x.startswith("SKIPPED") and "CUDA" in x]
    if out.returncode != 0 or skipped_cuda:
        print(out.stdout[-6000:], out.stderr[-2000:], sep="\n")
    return out.returncode == 0 and not skipped_cuda, summary


def run_bench(py: Path, t0: float) -> tuple[bool, dict | str]:
    report = WORK / "gpu-check" / "gpu_path_bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        out = subprocess.run([str(py), "-m", "benchmarks.transports.gpu_path", "--sizes-mb", "30",
                              "125", "--reps", "5", "--json", str(report)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=left(t0))
    except subprocess.TimeoutExpired:
        return False, "timed out"
    if out.returncode != 0:
        print(out.stdout[-4000:], out.stderr[-4000:], sep="\n")
        return False, f"exit {out.returncode}"
    return True, json.loads(report.read_text())


def check(python: str) -> int:
    t0 = time.monotonic()
    found = probe(python)
    if not found or not found.get("ok"):
        why = "no PyTorch" if not found else f"PyTorch {found['torch']} sees no CUDA device"
        print(f"gpu-check: no GPU ({python}: {why}); nothing to run", flush=True)
        return 0
    if not any(WHEELS.glob("epd_serve-*.whl")):
        print(f"gpu-check: {found['device']} found but no wheels in {WHEELS}; fetch them on a "
              "machine with the network: ./run.sh gpu-wheels", flush=True)
        return 1
    log(f"{found['device']}, torch {found['torch']} (CUDA {found['cuda']})")
    py = install(python, t0)
    tests_ok, tests = run_tests(py, t0)
    bench_ok, bench = run_bench(py, t0)
    print("=== gpu-check")
    print(f"device      {found['device']}  torch {found['torch']}  CUDA {found['cuda']}")
    print(f"CUDA tests  {'ok  ' if tests_ok else 'FAIL'} {tests}")
    if isinstance(bench, dict):
        for size, res in bench.items():
            copies = " ".join(f"{k}={v:.2f}" for k, v in res.get("copies", {}).items())
            e2e = " ".join(f"{k}={v['ms']:.1f}" for k, v in res.get("shm_e2e", {}).items())
            print(f"bench {size} MiB  copies ms: {copies}  shm e2e ms: {e2e}")
    else:
        print(f"bench       FAIL {bench}")
    print(f"total {time.monotonic() - t0:.0f} s (budget {BUDGET_S} s)", flush=True)
    return 0 if tests_ok and bench_ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fetch", action="store_true", help="download the wheels (network)")
    parser.add_argument("--python-version", default="3.12",
                        help="the GPU machine's Python (wheels for it)")
    args = parser.parse_args()
    if args.fetch:
        sys.exit(fetch(args.python_version))
    sys.exit(check(os.environ.get("EPD_GPU_PYTHON", "python3")))


if __name__ == "__main__":
    main()
