"""One Mooncake Store client, with bounded setup, deadlines and retries.

One Mooncake Store client (`MooncakeDistributedStore`) as the transport uses it: setup bounded
(the master is probed first: `setup` blocks ~90 s when none answers), every call with the
caller's deadline and bounded retries of transient errors, and a monitor thread that asks the
master itself whether it is alive (`health_check` says healthy after it died)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.transports.engine_ports import EngineRangeError, plan_engine_ports
from epd_common.net import parse_endpoint, port_open, resolve_host

logger = get_logger(__name__)

NOT_FOUND = -704
NO_SPACE = -200
TRANSIENT = {-800, -900, NO_SPACE, -1}  # worth another try (bounded, with backoff)
RPC_FAILED = -900
_HEALTH_KEY = "epd/health-probe"
_MISSING_BACKOFF_S = (0.005, 0.1)


class StoreUnavailable(RuntimeError):
    """The store cannot be used (no master, setup failed, master down)."""


class StoreClient:
    """A Mooncake Store client with bounded calls and a master monitor.

    One `MooncakeDistributedStore` client: bounded setup, calls with deadlines and retries,
    and a monitor that knows whether the master is alive."""

    def __init__(self, config: EPDConfig, segment_bytes: int, name: str,
                 on_down: Callable[[], None] | None = None) -> None:
        self.config = config
        self._on_down = on_down
        self.name = name
        self.master = config.store_master
        self._store = None
        self._alive = False
        self._down_since: float | None = time.monotonic()
        self._last_error = ""
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._on_connect: list[Callable[[], None]] = []
        self._segment_bytes = segment_bytes
        # Data calls run here so a call stuck on a frozen peer costs its caller only the
        # deadline (the thread finishes on its own when Mooncake gives up).
        self._calls = ThreadPoolExecutor(max(2, config.load_threads + 2),
                                         thread_name_prefix=f"{name}-call")
        self._health = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-health")
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(config.progress_timeout_s))
        self._connect(deadline=time.monotonic() + config.store_setup_timeout_s)
        self._monitor = threading.Thread(target=self._watch, name=f"{name}-monitor",
                                         daemon=True)
        self._monitor.start()

    # -- setup -----------------------------------------------------------------------------
    def _connect(self, deadline: float) -> None:
        try:  # its engine's listeners: the port plan's range, read when mooncake.store loads
            plan_engine_ports(self.config, "mooncake.store")
        except EngineRangeError as exc:
            raise StoreUnavailable(str(exc)) from None
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise StoreUnavailable(
                "transport 'mooncake_store' needs Mooncake: pip install 'epd-serve[cpu]' "
                "(mooncake-transfer-engine-non-cuda) or '[cuda]'; it needs libibverbs.so.1 "
                f"(apt-get install libibverbs1). Import failed: {exc}") from exc
        host, port = parse_endpoint(self.master)
        # setup() blocks for a long time retrying when no master answers: probe it first.
        if not port_open(host, port, max(0.1, min(2.0, deadline - time.monotonic()))):
            raise StoreUnavailable(
                f"Mooncake Store master {self.master} is not reachable: start it (`epd "
                "master`, or `epd up` with transport mooncake_store) or fix store_master")
        store = MooncakeDistributedStore()
        local = resolve_host(self.config.host)
        args = (local, self.config.store_metadata_url, self._segment_bytes, 0,
                self.config.protocol, self.config.device_name or
                os.environ.get("RDMA_DEVICE_NAME", "") if self.config.protocol == "rdma" else "",
                self.master)
        rc = self.bounded(lambda: store.setup(*args), deadline, executor=self._health)
        if rc is None or rc != 0:
            raise StoreUnavailable(
                f"Mooncake Store setup({local!r}, {self.config.store_metadata_url!r}, segment "
                f"{self._segment_bytes} bytes, {self.config.protocol!r}, master "
                f"{self.master!r}) " + ("timed out" if rc is None else f"failed with {rc}") +
                ": check store_master / store_metadata and that the master runs with its "
                "HTTP metadata server")
        with self._lock:
            self._store = store
        for hook in self._on_connect:
            hook()
        self.set_alive(True)

    def on_connect(self, hook: Callable[[], None]) -> None:
        """Run `hook` now if connected, and after every (re)connect (buffer registration)."""
        self._on_connect.append(hook)
        if self._store is not None:
            hook()

    @property
    def store(self):
        if self._store is None:
            raise StoreUnavailable(f"not connected to Mooncake Store master {self.master}")
        return self._store

    # -- health ------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._alive

    def set_alive(self, ok: bool, why: str = "") -> None:
        with self._lock:
            was, self._alive = self._alive, ok
            if ok:
                self._down_since = None
            elif was or self._down_since is None:
                self._down_since = time.monotonic()
                self._last_error = why
        if was and not ok:
            if self._on_down is not None:
                self._on_down()
            logger.error("EPD: Mooncake Store master %s is down (%s); its tier is skipped "
                         "until it answers again", self.master, why)
        elif ok and not was:
            logger.info("EPD: Mooncake Store master %s is up", self.master)

    def _watch(self) -> None:
        interval = self.config.store_health_interval_s
        while not self._closed.wait(interval):
            # An RPC to the master with a deadline: a dead master answers -900 at once, a
            # frozen one not at all (health_check() says healthy in both cases).
            rc = self.bounded(lambda: self._store.is_exist(_HEALTH_KEY),
                               time.monotonic() + max(1.0, interval), executor=self._health)
            if rc is None:
                self.set_alive(False, "master did not answer in time")
            elif rc < 0:
                self.set_alive(False, f"master RPC failed ({rc})")
            else:
                self.set_alive(True)

    def health(self) -> dict[str, object]:
        down = self._down_since
        return {"master": self.master, "ok": self._alive,
                "down_s": round(time.monotonic() - down, 1) if down is not None else 0.0,
                "last_error": self._last_error}

    # -- calls -------------------------------------------------------------------------------
    def bounded(self, fn: Callable[[], int], deadline: float,
                 executor: ThreadPoolExecutor | None = None,
                 on_late: Callable[[], None] | None = None) -> int | None:
        """Run a call in a worker thread, giving up at a deadline.

        fn() in a worker thread; its result, or None when `deadline` passed first (then
        `on_late` runs when the call finally returns)."""
        fut: Future = (executor or self._calls).submit(fn)
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            if on_late is not None:
                fut.add_done_callback(lambda _f: on_late())
            return None

    def call(self, fn: Callable[[], int], deadline: float, what: str,
             on_late: Callable[[], None] | None = None, retry_missing: bool = False) -> int:
        """Make one store call, retrying transient errors until the deadline.

        One store call with bounded retries on transient errors (and on "not found" when
        `retry_missing`: a producer's put may still be under way). Returns the last result;
        None-equivalent (timeout) is reported as -1 after `on_late` is armed."""
        backoff = self.config.store_retry_backoff_s
        tries = 0
        while True:
            if not self._alive:
                return RPC_FAILED
            rc = self.bounded(fn, deadline, on_late=on_late)
            if rc is None:
                self._last_error = f"{what}: deadline passed"
                return -1 if on_late is None else -2  # -2: a late call may still run
            if rc == RPC_FAILED:
                self.set_alive(False, f"{what} failed with {rc}")
            retry = (rc in TRANSIENT and rc != RPC_FAILED and tries < self.config.store_retries) \
                or (rc == NOT_FOUND and retry_missing)
            if not retry or time.monotonic() + backoff > deadline:
                return rc
            tries += rc != NOT_FOUND
            time.sleep(backoff)
            backoff = min(backoff * 2, _MISSING_BACKOFF_S[1] if rc == NOT_FOUND else 1.0)

    def close(self) -> None:
        self._closed.set()
        self._monitor.join(timeout=self.config.store_health_interval_s + 2)
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._health.shutdown(wait=False, cancel_futures=True)
        store, self._store = self._store, None
        if store is not None:
            # With the master gone, close() retries its unmount RPCs for long: bounded here,
            # the rest runs out in a daemon thread (the process is leaving anyway).
            closer = threading.Thread(target=_quiet_close, args=(store,), daemon=True,
                                      name=f"{self.name}-close")
            closer.start()
            closer.join(timeout=5.0 if self._alive else 0.5)


def _quiet_close(store) -> None:
    with contextlib.suppress(Exception):
        store.close()
