"""Whole stacks under load, each started by the benchmark itself:

- `serve.py`: four deployments of one model (aggregated vLLM; EPD through the gateway with
  a vLLM encoder or the encoder pool; vLLM's ECExampleConnector), with `serve_measure.py`
  (the load runs, the gateway's overhead, metadata-only against raw media) and
  `serve_report.py` (its table, CPU lines and ratios).
- `video.py`: video at real sizes (6-125 MB items), one request at a time, four ways.
- `epd_kv.py`: E/P/D beside E+PD and aggregated vLLM.
- `elastic.py`: a bursty trace against fixed and elastic fleets.
- `idle_cpu.py`: an E/P/D deployment's idle CPU, then a burst and sequential requests.
- `worker_spin.py`: a vLLM worker's spin between steps, vLLM's against the connector's.
- `conformance.py`: generated requests through EPD stacks against one aggregated vLLM
  server (docs/conformance.md).
"""
