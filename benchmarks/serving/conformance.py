"""Differential conformance run: generated requests through EPD stacks vs one aggregated vLLM
server of the same model (epd_testkit/conformance.py makes the cases).

    .venv/bin/python -m benchmarks.serving.conformance --seed 1 --cases 40 \
        --json .work/conformance.json

Starts the aggregated server once, then each stack in turn (`epd up` of a tiny test model,
`--model`, by default the Qwen2.5-Omni thinker (image, video, audio): a vLLM encoder or the
encoder pool, over safetensors, shared memory, the Mooncake Transfer Engine or NIXL;
the decode instance gets metadata-only items), and runs every case on every path: first encode,
cache hit and, on the stack with two decode instances, failover (a second gateway whose decode
instances sit behind proxies that break streams off mid-answer). Prints one line per
difference and a table of cases per cell; exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.harness.env import ROOT
from benchmarks.harness.processes import GatewayProcess, start_gateway
from benchmarks.harness.stack import Stack
from encoder_service.local.processes import UpProcess, VllmServer, default_work_dir, metric_value
from encoder_service.local.testmodels import SPECS, build
from epd_testkit.conformance import CuttingProxy, ask, cases

WORK = default_work_dir(ROOT)
STACKS = {  # name: (encoder backend, transport, decoders, prefill instances)
    "vllm+safetensors": ("vllm", "safetensors", 2, 0),
    "pool+safetensors": ("pool", "safetensors", 1, 0),
    "vllm+mooncake": ("vllm", "mooncake", 1, 0),
    "pool+mooncake": ("pool", "mooncake", 1, 0),
    "vllm+nixl": ("vllm", "nixl", 1, 0),  # the TE's wiring, NIXL reads (UCX) for the bytes
    "pool+nixl": ("pool", "nixl", 1, 0),
    "vllm+shm": ("vllm", "shm", 1, 0),  # what `epd up` picks on one host (transport auto)
    "pool+shm": ("pool", "shm", 1, 0),
    # E/P/D: a prefill instance hands each prompt's KV cache to one of two decode instances
    # (NixlConnector): the failover path cuts the decode instances' streams
    "epd-kv:vllm+shm": ("vllm", "shm", 2, 1),
    "epd-kv:pool+shm": ("pool", "shm", 2, 1),
    "epd-kv:vllm+mooncake": ("vllm", "mooncake", 2, 1),
    "epd-kv:pool+mooncake": ("pool", "mooncake", 2, 1),
}
DEFAULT_STACKS = [n for n in STACKS if not n.startswith("epd-kv:")]  # --stacks epd-kv: E/P/D
# pools encode every video of two or more temporal groups in chunks of one group
POOL = {"video_chunk_tokens": 1}
MEDIA_IO = {"video": {"num_frames": 64}}
# the aggregated server below every stack's ports (a stack takes base .. base + 31: gateway,
# encoder, decoders, failover gateway, cutting proxies); it once sat on stack 1's gateway
# port, where that stack's `epd up` could not start and its requests reached the reference.
# 20000-20279: clear of every test module's block (tests/helpers.py PORT_BLOCKS), so a fast
# lane beside a conformance run cannot answer the reference's requests (it did, from 18800)
AGG_PORT, BASE_PORT, STACK_PORTS = 20000, 20040, 40


def start_stack(name: str, port: int, model: str, work: Path, spec_name: str,
                media_io: dict) -> Stack:
    """One `epd up` run of stack `name`, started and healthy; with two decode instances, a
    failover gateway beside it whose decode instances sit behind `CuttingProxy`s."""
    backend, transport, decoders, prefills = STACKS[name]
    work = work / name
    work.mkdir(parents=True, exist_ok=True)
    storage = Path(tempfile.mkdtemp(prefix="ec-", dir=work))
    up = UpProcess({
        "model": spec_name, "base_port": port, "encoders": 1, "decoders": decoders,
        "prefills": prefills, "encoder_backend": backend, "transport": transport,
        "storage_path": str(storage), "mooncake_base_port": 15600 + port % 100 * 20,
        "vllm_args": ["--trust-request-mm-kwargs"], "media_io_kwargs": media_io,
        **({"pool": POOL} if backend == "pool" else {}),
        # nixl: every item a NIXL read, none inline in the side channel's reply
        **({"connector_extra": {"inline_max_bytes": 0}} if transport == "nixl" else {}),
        "gateway": {"timeouts": {"encoder_s": 60}}}, work).start()
    proxies: list[CuttingProxy] = []
    gw2: GatewayProcess | None = None

    def stop() -> None:
        for p in proxies:
            p.stop()
        if gw2 is not None:
            gw2.stop(30)
        up.stop(120)

    try:
        up.wait(600)  # this stack's gateway (it names its decoders), not another server
        if decoders >= 2:
            servers = [f"http://127.0.0.1:{port + 2 + i}" for i in range(decoders + prefills)]
            proxies += [CuttingProxy(d, port + 30 + i, seed=i).start()
                        for i, d in enumerate(servers[:decoders])]
            gw2 = start_gateway("gateway-failover", port + 29, work, model=model,
                                encoders=[f"http://127.0.0.1:{port + 1}"],
                                decoders=[p.url for p in proxies],
                                prefills=servers[decoders:],  # E/P/D: after the decoders
                                storage=storage, config={})
    except BaseException:
        stop()
        raise
    return Stack(name, model, up.url, stop, urls={"encoder": f"http://127.0.0.1:{port + 1}"},
                 failover_url=gw2.url if gw2 else None, prefills=prefills,
                 cuts=lambda: sum(p.cuts for p in proxies))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", type=int, default=40, help="generated cases (each runs on "
                    "every stack and path)")
    ap.add_argument("--stacks", nargs="+", default=DEFAULT_STACKS,
                    choices=[*STACKS, "epd-kv"], help="stacks to run (default: the E+PD ones; "
                    "epd-kv: every E/P/D stack)")
    ap.add_argument("--model", default="qwen-omni", choices=[n for n in SPECS if n != "large"],
                    help="the test model (cases use the modalities it serves)")
    ap.add_argument("--media-io-kwargs", type=json.loads, default=MEDIA_IO,
                    help="vLLM's --media-io-kwargs for every server (and pool) of every stack "
                    "and the aggregated reference (JSON; default keeps up to 64 video frames: "
                    "a server setting vLLM hashes into item names, as deployments of long "
                    "clips have)")
    ap.add_argument("--json", type=Path, default=WORK / "conformance.json")
    args = ap.parse_args()
    args.stacks = [n for s in args.stacks
                   for n in ([k for k in STACKS if k.startswith("epd-kv:")] if s == "epd-kv"
                             else [s])]
    spec = SPECS[args.model]
    model_dir = build(WORK / "models" / spec.model_name, spec)
    work = WORK / "conformance"
    client = httpx.Client(timeout=300)
    todo = cases(args.seed, args.cases, spec.modalities)
    print(f"conformance: {args.model}, seed {args.seed}, {len(todo)} cases x "
          f"{len(args.stacks)} stacks",
          flush=True)
    agg = VllmServer("aggregated", model_dir, AGG_PORT, work, None, cpu_core=None,
                     served_name=spec.model_name,
                     extra_args=["--trust-request-mm-kwargs", "--media-io-kwargs",
                                 json.dumps(args.media_io_kwargs)]).start()
    table: dict[str, dict[str, list[int]]] = {}  # stack -> path -> [equal, total]
    diffs: list[dict] = []
    evidence: dict[str, dict[str, int]] = {}  # stack -> the gateway's item outcomes
    try:
        agg.wait()
        refs = []
        for c in todo:
            refs.append(ask(client, agg.url, c.request(spec.model_name)))
        bad_refs = sum(r.status != 200 for r in refs)
        print(f"aggregated answers: {len(refs) - bad_refs} ok, {bad_refs} refused", flush=True)
        for c, r in zip(todo, refs, strict=True):
            if r.status != 200:  # EPD must refuse these the same way (counted equal then)
                print(f"  refused by aggregated: seed={c.seed} {c.kinds}: {r.status} "
                      f"{r.error}", flush=True)
        for i, name in enumerate(args.stacks):
            stack = start_stack(name, BASE_PORT + STACK_PORTS * i, spec.model_name, work,
                                args.model, args.media_io_kwargs)
            try:
                paths = {"first": stack.url, "hit": stack.url}
                if stack.failover_url:
                    paths["failover"] = stack.failover_url
                for path, url in paths.items():
                    cell = table.setdefault(name, {}).setdefault(path, [0, 0])
                    for c, ref in zip(todo, refs, strict=True):
                        got = ask(client, url, c.request(spec.model_name,
                                                         stream=path == "failover"))
                        ok = got.same(ref) or (ref.status != 200 and got.status == ref.status)
                        cell[0] += ok
                        cell[1] += 1
                        if not ok:
                            diffs.append({"stack": name, "path": path, "seed": c.seed,
                                          "kinds": c.kinds, "ref": ref.__dict__,
                                          "got": got.__dict__})
                            print(f"DIFF {name}/{path} seed={c.seed} {c.kinds}: "
                                  f"ref {ref.status} {ref.token_ids[:8]} {ref.text[:40]!r} "
                                  f"got {got.status} {got.token_ids[:8]} {got.text[:40]!r} "
                                  f"{got.error or ''}", flush=True)
                    print(f"{name:18s} {path:9s} {cell[0]}/{cell[1]} equal", flush=True)
                text = client.get(stack.url + "/metrics").text  # proof items went EPD's way
                items = {o: int(metric_value(text, f'epd_gateway_items_total{{outcome="{o}"}}'))
                         for o in ("encoded", "cache_hit", "metadata_only", "fallback")}
                raw = int(metric_value(text, "epd_gateway_raw_retries_total"))
                print(f"  items: {items}, metadata-only answers retried raw: {raw}",
                      flush=True)
                evidence[name] = {**items, "raw_retries": raw}
                if stack.prefills:  # proof the KV cache was handed over, not recomputed
                    kv = {k: int(metric_value(text, f"epd_kv_handoff{k}_total"))
                          for k in ("s", "_failures")}
                    print(f"  kv handoffs: {kv['s']}, failed: {kv['_failures']}", flush=True)
                    evidence[name].update(kv_handoffs=kv["s"], kv_failures=kv["_failures"])
                if STACKS[name][0] == "pool":  # proof the pool's videos went in chunks
                    r = client.get(stack.urls["encoder"] + "/v1/stats")
                    st = r.json() if r.status_code == 200 else {}
                    print(f"  pool: {st.get('chunked_items', 0)} videos encoded in "
                          f"{st.get('chunks', 0)} chunks", flush=True)
                if stack.failover_url and stack.cuts is not None:
                    text = client.get(stack.failover_url + "/metrics").text
                    resumed = metric_value(
                        text, 'epd_gateway_failovers_total{outcome="resumed"}')
                    print(f"  failover: streams cut {stack.cuts()}, "
                          f"resumed {resumed:.0f}", flush=True)
                    table[name]["failover"].append(int(resumed))
            finally:
                stack.stop()
    finally:
        agg.stop()
        client.close()
    total = sum(c[1] for t in table.values() for c in t.values())
    equal = sum(c[0] for t in table.values() for c in t.values())
    print(f"\n| stack | {' | '.join(('first', 'hit', 'failover'))} |\n|---|---|---|---|")
    for name, t in table.items():
        cells = [f"{t[p][0]}/{t[p][1]}" if p in t else "-" for p in ("first", "hit",
                                                                      "failover")]
        print(f"| {name} | {' | '.join(cells)} |")
    print(f"\n{equal}/{total} equal, {len(diffs)} differences")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": args.model, "seed": args.seed,
                                     "cases": len(todo), "table": table,
                                     "media_io_kwargs": args.media_io_kwargs,
                                     "items": evidence,
                                     "differences": diffs}, indent=1))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
