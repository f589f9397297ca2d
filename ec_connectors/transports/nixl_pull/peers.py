"""Our NIXL agent's views of its peers: their metadata checked and loaded, their regions.

A consumer loads each producer's agent metadata once (`add`: it must name the agent it is
sent as) and, for items a producer holds where they lie, that item's region (partial
metadata, `region_of` checked before NIXL sees it). NIXL cannot unload one region, so a view
holds at most `MAX_REMOTE_REGIONS` of them: past that, or when a region at a reused address
comes with other keys, the view is rebuilt from the producer's full metadata once its reads
in flight ended (reads count themselves in and out, `enter` / `leave`, and wait while a
view is rebuilt)."""

from __future__ import annotations

import contextlib
import re
import threading
import time

from ec_connectors.log import get_logger

logger = get_logger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# A consumer's view of a producer holds at most this many of its item regions (NIXL cannot
# unload one): past it, or when a region at a reused address comes with other keys, the view
# is rebuilt from the producer's full metadata once its reads in flight ended.
MAX_REMOTE_REGIONS = 1024
_REBUILD_WAIT_S = 2.0
_MAX_REGION_BYTES = 16 << 10  # far above one region's metadata with UCX (docs/benchmarks.md)


def valid_name(name: str) -> bool:
    """Whether `name` may name a NIXL agent (a peer's word, checked before use)."""
    return bool(_NAME.match(name))


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


class PeerViews:
    """What our agent (`raw`, NIXL's) has loaded of each peer, and the reads from each."""

    def __init__(self, raw: object, own_name: str) -> None:
        self._raw, self._own_name = raw, own_name
        self._peers: dict[str, bytes] = {}  # agent name -> the metadata loaded for it
        self._lock = threading.Lock()
        # per peer: reads in flight, the item regions loaded into its view, and whether the
        # view is being rebuilt (reads wait)
        self._changed = threading.Condition(self._lock)
        self._busy: dict[str, int] = {}
        self._regions: dict[str, set[bytes]] = {}
        self._rebuilding: set[str] = set()
        self.rebuilds = 0

    def add(self, claimed: str, metadata: bytes) -> str:
        """Load a peer's metadata; returns its name, or raises ValueError.

        The metadata must name the agent it is sent as; a name already loaded with other
        metadata is refused (a peer cannot take another producer's name)."""
        if not valid_name(claimed) or claimed == self._own_name:
            raise ValueError(f"bad NIXL agent name {claimed[:64]!r}")
        with self._lock:
            known = self._peers.get(claimed)
            if known is not None:
                if known != metadata:
                    raise ValueError(f"NIXL agent {claimed} is known with other metadata")
                return claimed
            try:
                name = self._raw.add_remote_agent(metadata)
            except Exception as exc:  # noqa: BLE001
                raise ValueError(f"bad NIXL metadata for {claimed}: {exc}") from exc
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            if name != claimed:
                with contextlib.suppress(Exception):
                    self._raw.remove_remote_agent(name)
                raise ValueError(f"NIXL metadata names {name!r}, sent as {claimed!r}")
            self._peers[claimed] = metadata
            return claimed

    def forget(self, name: str) -> None:
        """Unload a peer (its link closed; a restarted producer comes back as another)."""
        with self._lock:
            self._regions.pop(name, None)
            if self._peers.pop(name, None) is not None:
                with contextlib.suppress(Exception):
                    self._raw.remove_remote_agent(name)

    def enter(self, peer: str, region_md: bytes, deadline: float) -> bool:
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

    def leave(self, peer: str) -> None:
        """A read from `peer` ended (a rebuild of its view may go ahead)."""
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
                self._raw.add_remote_agent(region_md)
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
            self._raw.remove_remote_agent(peer)
            self._raw.add_remote_agent(full)
            self.rebuilds += 1
            self._raw.add_remote_agent(region_md)
            known.add(region_md)
            return True
        except Exception as exc:  # noqa: BLE001
            logger.warning("EPD nixl: cannot load a region of %s: %s", peer, exc)
            return False
        finally:
            self._rebuilding.discard(peer)
            self._changed.notify_all()

    def close(self) -> None:
        """Unload every peer."""
        with self._lock:
            peers, self._peers = list(self._peers), {}
        for name in peers:
            with contextlib.suppress(Exception):
                self._raw.remove_remote_agent(name)
