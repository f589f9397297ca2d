"""The project's benchmarks: a package run as modules from the repository root.

    python -m benchmarks.<group>.<name> --help

Grouped by subject (docs/benchmarks.md has each one's figures and the command behind them):
- `rivals/`: ours beside vLLM's own EC connectors and E/P/D (`run.py`; its deployments,
  workloads, handoff probe, report and the rivals' front ends beside it).
- `serving/`: whole stacks under load: `serve.py` (four deployments of one model),
  `video.py` (video at real sizes), `epd_kv.py` (E/P/D beside E+PD), `elastic.py`,
  `idle_cpu.py`, `worker_spin.py`, `conformance.py` (answers equal aggregated vLLM's),
  `starts.py` (a vLLM server's start, plain and from a fork server).
- `gateway/`: the gateway alone: `hop.py` (beside nginx and a bare Python proxy,
  `bare_proxy.py`), `tracing.py` (what tracing costs), `routing.py` (routing policies).
- `transports/`: one item producer -> consumer: `paths.py` (every transport beside memcpy
  and raw TCP), `mooncake.py`, `store.py`, `nixl_floor.py`, `in_place.py`, `gpu_path.py`
  (CUDA), `soak.py`.
- `encoder/`: the encoder pool: `pool.py` (batching), `batch.py` (an encoder's batch sizes),
  `video_chunk.py` (long videos in chunks).
- `harness/`: what they share (processes, fronts, load and CPU meters, report helpers,
  floors, plots); no benchmark imports another.
Those that start vLLM servers want the machine to themselves: on a shared machine run them
under one lock (`flock /tmp/epd-vllm.lock python -m ...`).
"""
