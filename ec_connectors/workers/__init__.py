"""The connector's WORKER role, in each vLLM worker process (the model runner's).

- `worker.py`: `EPDWorker`: a producer's saves (handed to a bounded background writer), a
  consumer's loads into staging on loader threads, and `place` into vLLM's encoder cache.
- `save_queue.py`: the producer's encoder outputs between `save` and the transport's `put`,
  bounded by count and bytes.
"""
