"""Encoder pool: the batching encoder server (`epd encoder`).

The batching encoder pool (`epd encoder`): an alternative to a vLLM encoder instance that
batches encoder work across requests and publishes embeddings a vLLM EPDConnector consumer
loads as its own.

- `server.py`: the HTTP app (`epd encoder`); `encode_handler.py`: its POST /encode (items
  that fail are reported, and the gateway sends them raw). `config.py`: `PoolConfig`.
- `media.py`: vLLM's media IO at the door; `models.py`: vLLM's encoders (LLaVA, Qwen2.5-VL,
  Qwen2.5-Omni with audio, Qwen3-VL) and their processors.
- `batching.py`: queues, batches formed shortest work first, dispatch, failures (a batch that
  runs out of memory is split, then items fail alone); `jobs.py`: what it queues and runs
  (jobs, workers, the batch being formed) and its refusals.
- `chunking.py`: a long video encoded in chunks of temporal groups, assembled by position map.
- `lifecycle.py`: the pool's item states and byte budgets; `publish.py`: transport +
  `ec_transfer_params`; `metrics.py`: Prometheus.
"""
