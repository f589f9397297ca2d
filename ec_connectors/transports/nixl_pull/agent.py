"""One process's NIXL agent: registration, metadata, reads with deadlines, notifications.

A thin, checked wrapper over `nixl._api.nixl_agent` (UCX back end): the agent runs without
NIXL's progress thread (it busy-polls a core), so progress happens when we poll a transfer's
state or the notifications, which the callers do with short sleeps while anything is in
flight. The agent is thread-safe (NIXL's read-write sync mode with lanes: transfers from
several threads at once, registration and peers exclusive; strict with one lane): a worker
both serves reads (notifications) and makes them (its loader threads).

Reads are posted by the agent's lanes, a thread per UCX worker: UCX binds a worker to a
thread at its first transfer, and on one host its get is a kernel copy made in the posting
thread, so a large read split across two lanes copies on two cores (docs/benchmarks.md,
"Figures behind the code's choices"). Only lanes post, so each keeps a worker of its own.
Nothing a peer sends is trusted: its metadata must name the agent it claims to be, and every read is
checked against the range the peer said it registered before NIXL sees it (NIXL checks it
again against the metadata).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple

from ec_connectors.log import get_logger

logger = get_logger(__name__)

_POLL_S = 0.0002  # between checks of a read in flight


class ReadState(StrEnum):
    """How a read ended (the values are what the log lines print)."""

    DONE = "DONE"
    FAILED = "ERR"
    TIMED_OUT = "TIMEOUT"  # the deadline passed; a live handle may still write the buffer


# smaller reads are one read on one lane: splitting them costs more hand-offs than it copies
STRIPE_MIN_BYTES = 4 << 20
_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# A consumer's view of a producer holds at most this many of its item regions (NIXL cannot
# unload one): past it, or when a region at a reused address comes with other keys, the view
# is rebuilt from the producer's full metadata once its reads in flight ended.
MAX_REMOTE_REGIONS = 1024
_REBUILD_WAIT_S = 2.0
_MAX_REGION_BYTES = 16 << 10  # far above one region's metadata with UCX (docs/benchmarks.md)


class Region(NamedTuple):
    """Memory registered on its own (an item held where it lies), and what reads it."""

    reg: object
    metadata: bytes  # NIXL's partial metadata of it: no connection info, what a reader loads


def region_of(agent: str, metadata: bytes) -> bool:
    """Whether `metadata` is partial NIXL metadata of `agent` that carries no connection info.

    Checked before NIXL loads it: a producer's region must not add places to another agent's
    view, nor change how we connect to it (NIXL's serialisation: the agent's name, then the
    number of connection entries, zero)."""
    name = agent.encode()
    head = (b"nixlSerDes|Agent" + len(name).to_bytes(8, "little") + name + b"|Conns"
            + (8).to_bytes(8, "little") + (0).to_bytes(8, "little") + b"|")
    return valid_name(agent) and len(metadata) <= _MAX_REGION_BYTES \
        and metadata.startswith(head)


class NixlUnavailable(RuntimeError):
    """NIXL cannot be imported or started in this process."""


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


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


def rdma_devices() -> bool:
    """Whether this host has RDMA devices (UCX would then register memory with them)."""
    root = Path("/sys/class/infiniband")
    try:
        return root.is_dir() and any(root.iterdir())
    except OSError:
        return False


class NixlAgent:
    """This process's agent (see the module docstring)."""

    def __init__(self, name: str, backends: tuple[str, ...] = ("UCX",), lanes: int = 1) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:
            raise NixlUnavailable(
                "transport 'nixl' needs NIXL: pip install --no-deps nixl nixl-cu12 (what "
                f"scripts/setup_env.py does). Import failed: {exc}") from exc
        # read-write sync: the lanes post at once on workers of their own; one lane is
        # every caller on one worker, serialised as before lanes
        sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW if lanes > 1 else \
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        config = nixl_agent_config(enable_prog_thread=False, backends=[], sync_mode=sync)
        try:
            self._agent = nixl_agent(name, config)
            for backend in backends:  # UCX: a worker per lane
                self._agent.create_backend(
                    backend, {"num_workers": str(lanes)} if backend == "UCX" else {})
        except Exception as exc:  # noqa: BLE001 - the bindings raise their own types
            raise NixlUnavailable(f"cannot start NIXL agent {name} ({backends}): {exc}") from exc
        if not self._agent.backends:
            raise NixlUnavailable(f"NIXL has none of the back ends {backends} here")
        self.name = name
        # one lane: reads are posted by their callers (one worker, no binding to keep)
        self.lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"epd-nixl-lane{i}")
                      for i in range(lanes)] if lanes > 1 else []
        self._regs: list[object] = []
        self._peers: dict[str, bytes] = {}  # agent name -> the metadata loaded for it
        self._lock = threading.Lock()
        # per peer: reads in flight, the item regions loaded into its view, and whether the
        # view is being rebuilt (reads wait); reads given up on stay counted until they end
        self._changed = threading.Condition(self._lock)
        self._busy: dict[str, int] = {}
        self._regions: dict[str, set[bytes]] = {}
        self._rebuilding: set[str] = set()
        self._given_up: dict[int, str] = {}  # id(handle) -> peer
        self.rebuilds = 0

    def register(self, addr: int, nbytes: int, location: str) -> None:
        """Register memory for this agent's whole life (the pool, the scratch page)."""
        self._regs.append(self._register(addr, nbytes, location)[1])

    def register_region(self, addr: int, nbytes: int, location: str) -> Region:
        """Register memory of its own (an item where it lies); `deregister` it when done."""
        descs, reg = self._register(addr, nbytes, location)
        try:
            return Region(reg, self._agent.get_partial_agent_metadata(
                descs, False, list(self._agent.backends)))
        except Exception as exc:  # noqa: BLE001
            self.deregister(Region(reg, b""))
            raise NixlUnavailable(f"NIXL partial metadata failed: {exc}") from exc

    def _register(self, addr: int, nbytes: int, location: str) -> tuple[object, object]:
        mem, device = mem_kind(location)
        descs = self._agent.get_reg_descs([(addr, nbytes, device, "")], mem)
        try:
            return descs, self._agent.register_memory(descs)
        except Exception as exc:  # noqa: BLE001 - the bindings raise their own types
            raise NixlUnavailable(f"NIXL register_memory of {nbytes} bytes of {mem} "
                                  f"failed: {exc}") from exc

    def deregister(self, region: Region) -> None:
        try:
            self._agent.deregister_memory(region.reg)
        except Exception as exc:  # noqa: BLE001 - the memory is dropped anyway
            logger.warning("EPD nixl: deregister_memory failed: %s", exc)

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_peer(self, claimed: str, metadata: bytes) -> str:
        """Load a peer's metadata; returns its name, or raises ValueError.

        The metadata must name the agent it is sent as; a name already loaded with other
        metadata is refused (a peer cannot take another producer's name)."""
        if not valid_name(claimed) or claimed == self.name:
            raise ValueError(f"bad NIXL agent name {claimed[:64]!r}")
        with self._lock:
            known = self._peers.get(claimed)
            if known is not None:
                if known != metadata:
                    raise ValueError(f"NIXL agent {claimed} is known with other metadata")
                return claimed
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception as exc:  # noqa: BLE001
                raise ValueError(f"bad NIXL metadata for {claimed}: {exc}") from exc
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            if name != claimed:
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)
                raise ValueError(f"NIXL metadata names {name!r}, sent as {claimed!r}")
            self._peers[claimed] = metadata
            return claimed

    def forget(self, name: str) -> None:
        with self._lock:
            self._regions.pop(name, None)
            if self._peers.pop(name, None) is not None:
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)

    def read(self, dest: tuple[int, int, str], remote: tuple[int, str, int], nbytes: int,
             peer: str, notif: bytes, deadline: float, chunk: int = 0,
             on_chunk: Callable[[int], None] | None = None,
             split: bool = True, region_md: bytes = b"") -> tuple[ReadState, object | None]:
        """READ `nbytes` from the peer's `remote` (addr, mem, device) into `dest`.

        `dest` is (addr, nbytes, location); `region_md` the partial metadata of the peer's
        region the bytes lie in when not in the range its full metadata registered (loaded
        into our view of it first, `region_of` checked by the caller). With `chunk`, the
        bytes come in reads of that size one after another, `on_chunk(end)` called as each
        lands (the caller verifies them while the next one is copied); the last carries
        `notif`. With `split`, each
        read is split across the lanes (else it goes whole to lane 0). Returns (DONE, None),
        (FAILED, None), or (TIMED_OUT, live) when the deadline passed with reads still in
        flight that NIXL could not cancel: the local buffer may still be written, so the
        caller holds it until `read_ended(live)`."""
        step = chunk if 0 < chunk < nbytes else nbytes
        for start in range(0, nbytes, step):
            n = min(step, nbytes - start)
            last = start + n == nbytes
            state, live = self._read_striped((dest[0] + start, dest[2]),
                                             (remote[0] + start, remote[1], remote[2]), n,
                                             peer, notif if last else b"", deadline, split,
                                             region_md)
            if state != ReadState.DONE:
                return ReadState(state), live
            if on_chunk is not None:
                on_chunk(start + n)
        return ReadState.DONE, None

    def stripes(self, nbytes: int, split: bool = True) -> int:
        """How many stripes a read of `nbytes` goes out in (1: whole)."""
        return len(self.lanes) if split and self.lanes and nbytes >= STRIPE_MIN_BYTES else 1

    def _read_striped(self, into: tuple[int, str], remote: tuple[int, str, int], nbytes: int,
                      peer: str, notif: bytes, deadline: float, split: bool = True,
                      region_md: bytes = b"") -> tuple[ReadState, object | None]:
        """One read, split into a stripe per lane when large and `split`.

        `notif` goes once all stripes landed: a stripe's own notification could reach the
        producer (which then unpins the item) while another stripe still copies."""
        if not self.lanes:
            return self._read_one(into, remote, nbytes, peer, notif, deadline, region_md)
        k = self.stripes(nbytes, split)
        per = -(-nbytes // k)
        try:
            if k == 1:
                return self.lanes[0].submit(self._read_one, into, remote, nbytes, peer,
                                            notif, deadline, region_md).result()
            runs = [lane.submit(self._read_one, (into[0] + i * per, into[1]),
                                (remote[0] + i * per, remote[1], remote[2]),
                                min(per, nbytes - i * per), peer, b"", deadline, region_md)
                    for i, lane in enumerate(self.lanes) if i * per < nbytes]
        except RuntimeError:  # the lanes were shut down: the agent is closing
            return ReadState.FAILED, None
        states = [run.result() for run in runs]
        live = [handle for _, handle in states if handle is not None]
        if live:  # a stripe NIXL could not cancel still writes: the caller holds the buffer
            return ReadState.TIMED_OUT, live
        for state in (ReadState.FAILED, ReadState.TIMED_OUT):
            if any(s == state for s, _ in states):
                return state, None
        if notif:
            self.lanes[0].submit(self._notify, peer, notif).result()
        return ReadState.DONE, None

    def _notify(self, peer: str, notif: bytes) -> None:
        try:
            self._agent.send_notif(peer, notif)
        except Exception as exc:  # noqa: BLE001 - the peer's pin then ends at its deadline
            logger.warning("EPD nixl: notification to %s failed: %s", peer, exc)

    def _read_one(self, into: tuple[int, str], remote: tuple[int, str, int], nbytes: int,
                  peer: str, notif: bytes, deadline: float, region_md: bytes = b""
                  ) -> tuple[ReadState, object | None]:
        if not self._enter(peer, region_md, deadline):
            return ReadState.FAILED, None
        handle = None
        try:
            mem, device = mem_kind(into[1])
            try:
                src = self._agent.get_xfer_descs([(into[0], nbytes, device)], mem)
                dst = self._agent.get_xfer_descs([(remote[0], nbytes, remote[2])], remote[1])
                handle = self._agent.initialize_xfer("READ", src, dst, peer, notif)
                state = self._agent.transfer(handle, notif)
            except Exception as exc:  # noqa: BLE001
                logger.warning("EPD nixl: read of %d bytes from %s failed to start: %s",
                               nbytes, peer, exc)
                if handle is not None:
                    self.release(handle)
                    handle = None
                return ReadState.FAILED, None
            while state == "PROC":
                if time.monotonic() >= deadline:
                    if self.release(handle):
                        handle = None
                        return ReadState.TIMED_OUT, None
                    with self._lock:  # still ours to count until it ends
                        self._given_up[id(handle)] = peer
                    return ReadState.TIMED_OUT, handle
                time.sleep(_POLL_S)
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception as exc:  # noqa: BLE001 - the read failed: released below
                    logger.warning("EPD nixl: read from %s failed: %s", peer, exc)
                    state = "ERR"
            self.release(handle)
            handle = None
            return (ReadState.DONE if state == "DONE" else ReadState.FAILED), None
        finally:
            if handle is None:
                self._leave(peer)

    def _enter(self, peer: str, region_md: bytes, deadline: float) -> bool:
        """Count a read from `peer` in flight, `region_md` loaded into our view of it first.

        False (the read fails, a miss) when the view cannot take the region by `deadline`."""
        with self._changed:
            if not self._changed.wait_for(lambda: peer not in self._rebuilding,
                                          max(0.0, deadline - time.monotonic())):
                return False
            if region_md and region_md not in self._regions.setdefault(peer, set()) \
                    and not self._load_region(peer, region_md, deadline):
                return False
            self._busy[peer] = self._busy.get(peer, 0) + 1
            return True

    def _leave(self, peer: str) -> None:
        with self._changed:
            left = self._busy.get(peer, 0) - 1
            if left > 0:
                self._busy[peer] = left
            else:
                self._busy.pop(peer, None)
                self._changed.notify_all()

    def _load_region(self, peer: str, region_md: bytes, deadline: float) -> bool:
        """Load a region of `peer` (lock held), rebuilding the view when it must."""
        known = self._regions[peer]
        full = self._peers.get(peer)
        if full is None:  # forgotten (its link closed): nothing to read from
            return False
        if len(known) < MAX_REMOTE_REGIONS:
            try:
                self._agent.add_remote_agent(region_md)
                known.add(region_md)
                return True
            except Exception:  # noqa: BLE001 - an old region at this address, other keys
                pass
        self._rebuilding.add(peer)
        try:
            wait = min(_REBUILD_WAIT_S, max(0.0, deadline - time.monotonic()))
            if not self._changed.wait_for(lambda: not self._busy.get(peer), wait):
                logger.warning("EPD nixl: reads from %s still in flight; its view is not "
                               "rebuilt now (this read is a miss)", peer)
                return False
            known.clear()
            self._agent.remove_remote_agent(peer)
            self._agent.add_remote_agent(full)
            self.rebuilds += 1
            self._agent.add_remote_agent(region_md)
            known.add(region_md)
            return True
        except Exception as exc:  # noqa: BLE001
            logger.warning("EPD nixl: cannot load a region of %s: %s", peer, exc)
            return False
        finally:
            self._rebuilding.discard(peer)
            self._changed.notify_all()

    def read_ended(self, live: object) -> bool:
        """Whether a read given up on has ended (its handles are then released).

        `live` is what `read` returned, one handle or a stripe's list, emptied as they end."""
        handles = live if isinstance(live, list) else [live]
        ended = [h for h in handles
                 if self._agent.check_xfer_state(h) != "PROC" and self.release(h)]
        for h in ended:
            with self._lock:
                peer = self._given_up.pop(id(h), None)
            if peer is not None:
                self._leave(peer)
        handles[:] = [h for h in handles if all(h is not e for e in ended)]
        return not handles

    def release(self, handle: object) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - still active and not cancellable
            return False
        return True

    def notifications(self) -> list[bytes]:
        """New notifications from any peer (polling them also makes UCX progress)."""
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as exc:  # noqa: BLE001
            logger.warning("EPD nixl: reading notifications failed: %s", exc)
            return []
        return [m for msgs in notifs.values() for m in msgs]

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers), {}
        for name in peers:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(name)
        for reg in self._regs:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(reg)
        self._regs.clear()
        for lane in self.lanes:
            lane.shutdown(wait=False)
