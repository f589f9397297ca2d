"""Ours beside vLLM's own EC connectors and E/P/D: `python -m benchmarks.rivals.run`.

- `run.py`: the benchmark (rounds, deployments, workloads, the table, the JSON).
- `stacks.py`: its deployments, each started fresh (ours as `epd up` starts them, vLLM's
  as its examples run them), every server through the handoff probe.
- `workloads.py`: the same requests for every deployment (light, distinct, video, video
  with images; text cases for a P/D deployment without an encoder).
- `probe.py`: the handoff probe (`vllm serve` and `epd encoder` run through it: when each
  item's encoder output was done and when it was placed on the consumer).
- `report.py`: one round's numbers, medians over rounds, answers against aggregated vLLM's,
  the table, the ratios, the JSON and the chart.
- `mooncake_front.py`: the front of vLLM's ECMooncakeConnector deployment (it pushes);
  `epd_front.py`: the flow of vLLM's disaggregated-encoder proxy (E/P/D and plain P/D).
  Both run on the front skeleton in benchmarks/harness/fronts.py.
"""
