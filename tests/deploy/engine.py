"""The container engine of the deploy lane (`./run.sh test-deploy`): podman with
podman-compose, installed when missing (apt as root; podman-compose from PyPI into a small
virtualenv of its own), a Debian base image built with debootstrap (no registry image can be
pulled on these machines), and the project's image built from the Dockerfile on it.

Why podman: it runs without a daemon (no systemd here), and Debian ships it. Settings it needs
on these machines come from deploy/podman/containers.conf (via $CONTAINERS_CONF, nothing
written under /etc): runc (crun rejects the hybrid cgroup layout), cgroupfs, file events, and
default ulimits the missing CAP_SYS_RESOURCE allows.

Cached between runs: the base image (tagged with BASE_VERSION), the image's layers (the
dependency layer is rebuilt only when the dependency list changes), the podman-compose venv.
Everything a run starts carries the compose project's label (or LABEL below) and is removed
by `clean()`, which `leftovers()` then checks.

    python -m tests.deploy.engine prepare     install, build the base and the image
    python -m tests.deploy.engine clean       remove what the lane started (and check)
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import tomllib

from tests.helpers import ROOT, WORK

DEPLOY_WORK = WORK / "deploy"
CONTAINERS_CONF = ROOT / "deploy" / "podman" / "containers.conf"
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROJECT = "epd-deploy-test"  # the compose project: containers, networks, volumes carry it
LABEL = "epd-deploy-test=1"  # the lane's own throwaway containers
APT_PACKAGES = ["podman", "runc", "netavark", "aardvark-dns", "catatonit", "iptables",
                "debootstrap"]
PODMAN_COMPOSE = "podman-compose==1.6.0"
BASE_VERSION = "1"  # bump to rebuild the base image
BASE_PACKAGES = ["python3", "python3-venv", "ca-certificates"]  # what python:3.11-slim has
# pip settings passed to the image build, as the build machine's pip uses them
PIP_KEYS = ["index-url", "extra-index-url", "find-links", "cert", "constraint"]


def settings() -> dict:
    """deploy/settings.toml: what docker-compose.yml was rendered from."""
    return tomllib.loads((ROOT / "deploy" / "settings.toml").read_text())


def image_name() -> str:
    """The image docker-compose.yml runs, as podman names it."""
    name = settings()["image"]
    return name if "/" in name else f"localhost/{name}"


def log(msg: str) -> None:
    print(f"[deploy] {msg}", flush=True)


def engine_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def run(cmd: list[str], *, check: bool = True, timeout: float = 600, capture: bool = True,
        env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=check, timeout=timeout, text=True,
                          capture_output=capture, env=env or engine_env(), **kw)


def podman(*args: str, check: bool = True, timeout: float = 120) -> str:
    return run(["podman", *args], check=check, timeout=timeout).stdout


# -- install ---------------------------------------------------------------------------------
def ensure_packages() -> None:
    """podman and what it needs here, from Debian (idempotent: nothing runs when present)."""
    wanted = {"podman": "podman", "runc": "runc", "iptables": "iptables",
              "debootstrap": "debootstrap", "catatonit": "catatonit"}
    missing = [pkg for binary, pkg in wanted.items() if not shutil.which(binary)]
    for pkg, path in (("netavark", "/usr/lib/podman/netavark"),
                      ("aardvark-dns", "/usr/lib/podman/aardvark-dns")):
        if not Path(path).exists():
            missing.append(pkg)
    if not missing:
        return
    if not can_apt():
        raise RuntimeError(f"the deploy lane needs {' '.join(missing)} (apt-get install as "
                           "root); not root or no apt here")
    log(f"installing {' '.join(missing)} with apt-get")
    apt_install(APT_PACKAGES)


def can_apt() -> bool:
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def apt_install(packages) -> None:
    """Debian `packages` (no recommends), the package lists refreshed only when needed."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    if run(cmd, check=False, env=env, timeout=900).returncode != 0:
        run(["apt-get", "update", "-qq"], env=env, timeout=600)
        run(cmd, env=env, timeout=900)


def compose_bin() -> Path:
    """podman-compose in DEPLOY_WORK/tools (a venv of its own, made once)."""
    tools = DEPLOY_WORK / "tools"
    exe = tools / "bin" / "podman-compose"
    stamp = tools / ".installed"
    if exe.exists() and stamp.exists() and stamp.read_text() == PODMAN_COMPOSE:
        return exe
    run([sys.executable, "-m", "venv", "--clear", tools], env=dict(os.environ))
    run([tools / "bin" / "pip", "install", "-q", PODMAN_COMPOSE], env=dict(os.environ))
    stamp.write_text(PODMAN_COMPOSE)
    return exe


# -- the base image --------------------------------------------------------------------------
def os_release() -> dict[str, str]:
    out = {}
    for line in Path("/etc/os-release").read_text().splitlines():
        key, _, value = line.partition("=")
        out[key] = value.strip('"')
    return out


def apt_mirror(codename: str) -> str:
    """The Debian mirror apt already uses for `codename` (deb822 or one-line sources)."""
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for f in files:
        if not f.is_file():
            continue
        text = f.read_text()
        for block in re.split(r"\n\s*\n", text):  # deb822 stanzas
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.+)$", block, re.M))
            if "deb" in fields.get("Types", "").split() and \
                    codename in fields.get("Suites", "").split():
                return fields["URIs"].split()[0]
        for line in text.splitlines():  # deb [opts] URI SUITE COMPONENTS
            parts = re.sub(r"\[[^]]*\]", "", line).split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == codename:
                return parts[1]
    return "http://deb.debian.org/debian"


def base_image() -> str:
    codename = os_release().get("VERSION_CODENAME", "bookworm")
    return f"localhost/epd-base:{codename}-{BASE_VERSION}"


def ensure_base() -> str:
    """The Dockerfile's BASE here: Debian minbase with Python 3 and the host's CA bundle
    (HTTPS from a build may go through a proxy only that bundle trusts). About 3 minutes
    once, then cached under its tag."""
    tag = base_image()
    if run(["podman", "image", "exists", tag], check=False).returncode == 0:
        return tag
    codename = tag.split(":")[1].rsplit("-", 1)[0]
    t0 = time.monotonic()
    DEPLOY_WORK.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="base-", dir=DEPLOY_WORK) as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             codename, rootfs, apt_mirror(codename)], timeout=1200)
        bundle = Path("/etc/ssl/certs/ca-certificates.crt")
        if bundle.exists():
            shutil.copy(bundle, rootfs / "etc/ssl/certs/ca-certificates.crt")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc",
                     "usr/share/man", "usr/share/locale"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file() or p.is_symlink():
                    p.unlink()
                else:
                    shutil.rmtree(p)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(["podman", "import", "--change", "CMD [\"python3\"]", "-",
                              tag], stdin=tar.stdout, env=engine_env(), capture_output=True,
                             text=True, timeout=600)
        tar.stdout.close()
        tar.wait()
        if imp.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"podman import failed: {imp.stderr[-2000:]}")
    log(f"base image {tag} built in {time.monotonic() - t0:.0f} s")
    return tag


# -- the image -------------------------------------------------------------------------------
def pip_settings() -> dict[str, list[str]]:
    """This machine's pip settings (config files, then $PIP_* over them, as pip reads them)."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True).stdout
    out: dict[str, list[str]] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        if name in PIP_KEYS and scope != ":env:":
            out[name] = str(ast.literal_eval(value)).split()
    for name in PIP_KEYS:
        env = os.environ.get("PIP_" + name.upper().replace("-", "_"))
        if env:
            out[name] = env.split()
    return out


def build_args() -> list[str]:
    """--build-arg PIP_* and read-only mounts of the local paths they name."""
    args: list[str] = []
    mounts: set[Path] = set()
    for name, vals in pip_settings().items():
        for v in vals:
            path = Path(urlparse(v).path) if v.startswith("file://") else Path(v)
            if path.is_absolute() and path.exists():
                # an index's pages link to files beside it (../../files/...): mount its parent
                mounts.add(path.parent if path.name == "simple" else path)
        args += ["--build-arg", f"PIP_{name.upper().replace('-', '_')}={' '.join(vals)}"]
    for m in sorted(mounts):
        args += ["--volume", f"{m}:{m}:ro"]
    return args


def build_image(base: str) -> float:
    """Build the image (cached layers); returns the seconds it took."""
    t0 = time.monotonic()
    log_path = DEPLOY_WORK / "build.log"
    log(f"building {image_name()} (log {log_path})")
    with open(log_path, "w") as out:  # as it goes: a first build takes minutes
        proc = run(["podman", "build", "--layers", "--pull=never", "--build-arg",
                    f"BASE={base}", *build_args(), "-t", image_name(), "-f",
                    ROOT / "Dockerfile", ROOT], timeout=2400, check=False, capture=False,
                   stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"image build failed (log {log_path}):\n"
                           f"{log_path.read_text()[-4000:]}")
    took = time.monotonic() - t0
    log(f"image {image_name()} built in {took:.0f} s, {image_size() / 1e9:.2f} GB")
    return took


def image_size(name: str | None = None) -> int:
    return int(podman("image", "inspect", "--format", "{{.Size}}", name or image_name()))


def prepare() -> dict[str, float]:
    DEPLOY_WORK.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ensure_packages()
    compose_bin()
    installed = time.monotonic() - t0
    base = ensure_base()
    based = time.monotonic() - t0 - installed
    built = build_image(base)
    out = {"install_s": installed, "base_s": based, "build_s": built,
           "image_bytes": image_size()}
    (DEPLOY_WORK / "prepare.json").write_text(json.dumps(out))
    return out


# -- clean-up ----------------------------------------------------------------------------------
FILTERS = [f"label=io.podman.compose.project={PROJECT}", f"label={LABEL.split('=')[0]}"]


def _ids(kind: str) -> list[str]:
    ids: list[str] = []
    for f in FILTERS:
        if kind == "container":
            out = podman("ps", "-a", "-q", "--filter", f, check=False)
        else:
            out = podman(kind, "ls", "-q", "--filter", f, check=False)
        ids += [i for i in out.split() if i not in ids]
    return ids


def leftovers() -> dict[str, list[str]]:
    """What the lane started that still exists."""
    if not shutil.which("podman"):
        return {}
    found = {kind: _ids(kind) for kind in ("container", "network", "volume")}
    return {k: v for k, v in found.items() if v}


def clean(compose_exe: Path | None = None) -> dict[str, list[str]]:
    """Take the compose project down (containers, networks, volumes), then remove anything
    left by id; returns what is still there (nothing, normally)."""
    if not shutil.which("podman"):
        return {}
    exe = compose_exe or (DEPLOY_WORK / "tools" / "bin" / "podman-compose")
    if exe.exists():
        run([exe, "--project-name", PROJECT, "-f", COMPOSE_FILE, "down", "--volumes",
             "--timeout", "5"], check=False, timeout=300,
            env={**engine_env(), "EPD_SECRET_PATH": "/dev/null"})
    for cid in _ids("container"):
        podman("rm", "--force", "--volumes", "--time", "0", cid, check=False)
    for nid in _ids("network"):
        podman("network", "rm", "--force", nid, check=False)
    for vid in _ids("volume"):
        podman("volume", "rm", "--force", vid, check=False)
    return leftovers()


def main(argv: list[str]) -> int:
    if argv == ["prepare"]:
        log(json.dumps(prepare()))
        return 0
    if argv == ["clean"]:
        left = clean()
        if left:
            log(f"LEFT BEHIND: {left}")
            return 1
        log("no container, network or volume of the lane left")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
