"""Our NIXL agent's reads: posted by lanes, polled to their end, notifications.

The agent runs without NIXL's progress thread (it busy-polls a core), so progress happens
when we poll a transfer's state or the notifications, with short sleeps while anything is in
flight. Reads are posted by the agent's lanes, a thread per UCX worker: UCX binds a worker
to a thread at its first transfer, and on one host its get is a kernel copy made in the
posting thread, so a large read split across two lanes copies on two cores
(docs/benchmarks.md, "Figures behind the code's choices"). Only lanes post, so each keeps a
worker of its own; with one lane, reads are posted by their callers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum

from ec_connectors.log import get_logger
from ec_connectors.transports.nixl_pull.host import mem_kind
from ec_connectors.transports.nixl_pull.peers import PeerViews

logger = get_logger(__name__)

_POLL_S = 0.0002  # between checks of a read in flight
# smaller reads are one read on one lane: splitting them costs more hand-offs than it copies
STRIPE_MIN_BYTES = 4 << 20


class ReadState(StrEnum):
    """How a read ended (the values are what the log lines print)."""

    DONE = "DONE"
    FAILED = "ERR"
    TIMED_OUT = "TIMEOUT"  # the deadline passed; a live handle may still write the buffer


class Reads:
    """Reads from peers through our agent (`raw`, NIXL's), on `lanes` lanes (see the module).

    `views` counts each read in and out of its peer's view (peers.py)."""

    def __init__(self, raw: object, views: PeerViews | None, lanes: int = 1) -> None:
        self._raw, self._views = raw, views
        self.lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"epd-nixl-lane{i}")
                      for i in range(lanes)] if lanes > 1 else []
        self._lock = threading.Lock()
        self._given_up: dict[int, str] = {}  # id(handle) -> peer: counted until it ends

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
        `notif`. With `split`, each read is split across the lanes (else it goes whole to
        lane 0). Returns (DONE, None), (FAILED, None), or (TIMED_OUT, live) when the
        deadline passed with reads still in flight that NIXL could not cancel: the local
        buffer may still be written, so the caller holds it until `read_ended(live)`."""
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
            self._raw.send_notif(peer, notif)
        except Exception as exc:  # noqa: BLE001 - the peer's pin then ends at its deadline
            logger.warning("EPD nixl: notification to %s failed: %s", peer, exc)

    def _read_one(self, into: tuple[int, str], remote: tuple[int, str, int], nbytes: int,
                  peer: str, notif: bytes, deadline: float, region_md: bytes = b""
                  ) -> tuple[ReadState, object | None]:
        if not self._views.enter(peer, region_md, deadline):
            return ReadState.FAILED, None
        handle = None
        try:
            mem, device = mem_kind(into[1])
            try:
                src = self._raw.get_xfer_descs([(into[0], nbytes, device)], mem)
                dst = self._raw.get_xfer_descs([(remote[0], nbytes, remote[2])], remote[1])
                handle = self._raw.initialize_xfer("READ", src, dst, peer, notif)
                state = self._raw.transfer(handle, notif)
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
                    state = self._raw.check_xfer_state(handle)
                except Exception as exc:  # noqa: BLE001 - the read failed: released below
                    logger.warning("EPD nixl: read from %s failed: %s", peer, exc)
                    state = "ERR"
            self.release(handle)
            handle = None
            return (ReadState.DONE if state == "DONE" else ReadState.FAILED), None
        finally:
            if handle is None:
                self._views.leave(peer)

    def read_ended(self, live: object) -> bool:
        """Whether a read given up on has ended (its handles are then released).

        `live` is what `read` returned, one handle or a stripe's list, emptied as they end."""
        handles = live if isinstance(live, list) else [live]
        ended = [h for h in handles
                 if self._raw.check_xfer_state(h) != "PROC" and self.release(h)]
        for h in ended:
            with self._lock:
                peer = self._given_up.pop(id(h), None)
            if peer is not None:
                self._views.leave(peer)
        handles[:] = [h for h in handles if all(h is not e for e in ended)]
        return not handles

    def release(self, handle: object) -> bool:
        """Release a transfer handle; False while it is active and cannot be cancelled."""
        try:
            self._raw.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - still active and not cancellable
            return False
        return True

    def notifications(self) -> list[bytes]:
        """New notifications from any peer (polling them also makes UCX progress)."""
        try:
            notifs = self._raw.get_new_notifs()
        except Exception as exc:  # noqa: BLE001
            logger.warning("EPD nixl: reading notifications failed: %s", exc)
            return []
        return [m for msgs in notifs.values() for m in msgs]

    def close(self) -> None:
        """Stop the lanes (a read posted later fails)."""
        for lane in self.lanes:
            lane.shutdown(wait=False)
