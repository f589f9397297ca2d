"""Every upstream pool of the gateway as one fleet: what to probe, and what a probe says.

The pools are the decode instances, the encoders (their router) and, under E/P/D, the
prefill instances. A failed probe puts an instance last until a probe passes (`probed`);
instances a supervisor reports down are left to it (outages.py).
"""

from __future__ import annotations

import logging

from encoder_service.gateway.upstreams.decoders import DecodePool
from encoder_service.gateway.upstreams.encoder_clients import EncoderRouter
from encoder_service.gateway.upstreams.probes import Prober
from encoder_service.gateway.upstreams.routing import Members

logger = logging.getLogger("epd.gateway")


class Fleet:
    """The gateway's upstream pools and how each instance is probed.

    The pools, and how each instance is probed: a real forward ("vllm") or an `epd
    encoder` pool's /health ("pool", when `pool_encoders`)."""

    def __init__(self, decoders: DecodePool, router: EncoderRouter,
                 prefills: DecodePool | None, pool_encoders: bool, fail_hold_s: float
                 ) -> None:
        self.decoders, self.router, self.prefills = decoders, router, prefills
        self.pool_encoders = pool_encoders
        self.fail_hold_s = fail_hold_s  # a failed probe: tried last this long at least
        self.prober: Prober | None = None  # set once made (it calls back into the fleet)

    def pools(self) -> list[Members]:
        """Decode instances, encoders, prefill instances (E/P/D)."""
        return [self.decoders, self.router, *([self.prefills] if self.prefills else [])]

    def load(self) -> dict[str, float]:
        """Each role's load now: what `epd up`'s scaler and a Kubernetes HPA grow a role on.

        encoder: encode calls in flight (queued for a shared call or sent) plus the images
        waiting for a shared call (coalescing.py), over the encoders that may get work;
        decode (and prefill, E/P/D): requests in flight, streams included."""
        r = self.router
        out = {"encoder": float(sum(r.inflight.get(n, 0) for n in r.names())
                                + sum(getattr(c, "waiting", 0) for c in r.clients.values())),
               "decode": float(sum(self.decoders.inflight.get(u, 0)
                                   for u in self.decoders.urls))}
        if self.prefills is not None:
            out["prefill"] = float(sum(self.prefills.inflight.get(u, 0)
                                       for u in self.prefills.urls))
        return out

    def probe_targets(self) -> list[tuple[str, str]]:
        """Every instance but those down (a supervisor probes them back: outages.py)."""
        return [(u, self.probe_kind(u)) for pool in self.pools() for u in pool.names()
                if u not in pool.down]

    def probe_kind(self, url: str) -> str:
        pool = (self.pool_encoders and url not in self.decoders.urls
                and (self.prefills is None or url not in self.prefills.urls))
        return "pool" if pool else "vllm"

    def probed(self, url: str, ok: bool) -> None:
        """A failed probe: tried last until the next probe passes; a passed one clears it."""
        for pool in self.pools():
            if url in pool.down_until:
                pool.cool_down(url, 0.0 if ok else self.fail_hold_s)
        if not ok:
            result = self.prober.results.get(url) if self.prober else None
            logger.warning("probe failed url=%s error=%s action=tried last until a probe "
                           "passes", url, result.error if result else "")

