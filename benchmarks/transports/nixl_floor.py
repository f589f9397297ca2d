"""NIXL's own READ between two processes, nothing of ours around it: the floor of `nixl`.

    .venv/bin/python -m benchmarks.transports.nixl_floor [--sizes-mb 125] [--reps 7] \
        [--ucx-tls tcp]

Two agents (UCX, no progress thread, as the transport makes them), each with a buffer of
the item's size registered once; the reader loads the other's metadata and READs the whole
buffer into its own, polling the transfer's state, median of `reps` after one warm-up (UCX
sets up its connection on the first transfer). No checksum, no side channel, no pool: what
UCX itself costs for the bytes, beside which `transports/paths.py`'s `nixl` rows are read
(there is no `ucx_perftest` in the wheels: where Debian's `ucx-utils` is installed, UCX's own
`ucx_perftest -t ucp_get` of the same size is printed beside; a distribution's UCX, not the
wheel's). Both are benchmarks/harness/floors.py's, which `transports/paths.py` runs beside
its `nixl` paths.
"""

from __future__ import annotations

import argparse

from benchmarks.harness.floors import nixl_read_s, ucx_get_s
from benchmarks.harness.report import MiB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[125])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ucx-tls", default="", help="UCX_TLS for both agents (default: UCX's)")
    args = ap.parse_args()
    env = {"UCX_TLS": args.ucx_tls} if args.ucx_tls else {}
    for mb in args.sizes_mb:
        ms = nixl_read_s(int(mb * MiB), args.reps, env) * 1e3
        print(f"{mb:g} MiB NIXL READ ({args.ucx_tls or 'UCX default'}): {ms:.1f} ms")
        ucx = ucx_get_s(int(mb * MiB), args.reps, env)
        print(f"{mb:g} MiB ucx_perftest ucp_get: " + (f"{ucx * 1e3:.1f} ms" if ucx else
              "not installed (apt install ucx-utils)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
