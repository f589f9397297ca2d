"""What every benchmark shares; nothing here is a benchmark of its own.

- `report.py`: `say` (one progress line, tagged with the running benchmark), `medians`,
  `percentile`, `ms` (seconds -> milliseconds), `MiB`.
- `processes.py`: `GatewayProcess` (`epd gateway` as its own process), `StandIn` (a decode
  instance that answers at once or after a delay; this module run as a process),
  `example_config` (a vLLM server's ECExampleConnector config).
- `env.py`: `ROOT` (the clone) and `pythonpath_env` (a child finds `benchmarks` and
  `epd_testkit` there).
- `stack.py`: `Stack`, a started deployment under test (its URL, what its CPU meter counts,
  how it stops).
- `fronts.py`: the skeleton of a front end that is not our gateway (a flow's `prepare`,
  the relay, per-request timing lines in the gateway's format, `FrontProcess`).
- `load.py`: `CpuMeter` (CPU per request per server, each core's busy share), `warm`,
  `stage_means` (mean time per stage from /metrics).
- `procfs.py`: process trees and per-thread CPU ticks from /proc.
- `floors.py`: the limits a transport is measured beside: memcpy, raw TCP on loopback,
  NIXL's own READ, UCX's perftest get (this module run as the processes that need a peer).
- `netns.py`: two "hosts" on one machine (network namespaces and a veth pair; root).
- `peers.py`: item sizes and the Mooncake TE get through `epd_testkit.peer_process` peers.
- `video.py`: the `qwen3-vl-video` model's video workload (clips of real item sizes).
- `plots.py`: grouped bar charts (matplotlib, optional).
"""
