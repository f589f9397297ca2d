"""The encoder pool (`epd encoder`):

- `pool.py`: batching on against off, 32 clients, the feature budget.
- `batch.py`: one encoder's images/s per batch size (CPU or CUDA).
- `video_chunk.py`: a long video encoded whole or in chunks, with images sent while it
  encodes.
"""
