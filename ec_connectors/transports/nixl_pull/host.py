"""What this host allows NIXL: memory kinds, kernel copies between processes, RDMA devices.

Read from the process's environment and the kernel: `UCX_TLS` (whether UCX may copy between
processes in the kernel, cma), /proc (which booted kernel and pid namespace this process
runs in: two processes that share both read each other's memory with one kernel copy) and
/sys (RDMA devices, with which UCX would register every page it is given)."""

from __future__ import annotations

import os
from pathlib import Path


def mem_kind(location: str) -> tuple[str, int]:
    """NIXL's memory type and device id for a torch location ("cpu", "cpu:0", "cuda:1").

    Host memory is DRAM (device id 0); a GPU's is VRAM on that GPU, so a pool on the GPU is
    registered as VRAM and read there by a NIXL back end that moves device memory."""
    kind, _, index = location.partition(":")
    if kind == "cpu":
        return "DRAM", 0
    if kind == "cuda" and (index == "" or index.isdigit()):
        return "VRAM", int(index or 0)
    raise ValueError(f"NIXL cannot register memory on {location!r}")


def _cma_allowed(tls: str) -> bool:
    """Whether UCX may use cma under this `UCX_TLS` (a list, or "^" and the excluded)."""
    shared = {"cma", "sm", "shm"}
    if tls.startswith("^"):
        return not shared & set(tls[1:].split(","))
    return not tls or bool((shared | {"all"}) & set(tls.split(",")))


def kernel_identity() -> str:
    """Which booted kernel and pid namespace this process runs in ("" where unknown).

    Two processes that share both read each other's memory with one kernel copy (UCX's cma),
    which one thread makes: a read between them is split across the lanes. Between hosts
    (TCP, RDMA) a split only adds connections for the producer to serve; so it does where
    `UCX_TLS` leaves UCX no cma (docs/benchmarks.md has the split read over UCX's TCP)."""
    if not _cma_allowed(os.environ.get("UCX_TLS", "")):
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def rdma_devices() -> bool:
    """Whether this host has RDMA devices (UCX would then register memory with them)."""
    root = Path("/sys/class/infiniband")
    try:
        return root.is_dir() and any(root.iterdir())
    except OSError:
        return False
