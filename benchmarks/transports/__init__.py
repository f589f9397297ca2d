"""One item, producer process -> consumer process:

- `paths.py`: every transport path, verified, beside memcpy and raw TCP measured in the
  same run (and NIXL's and UCX's own floors; `--netns`: two namespaces).
- `mooncake.py`: the Mooncake TE transport against the bare engine and raw TCP; the
  scheduler's `has_cache_item` with 100,000 items.
- `store.py`: the Mooncake Store beside the TE get and raw TCP; `--secret`: what
  authentication costs.
- `nixl_floor.py`: NIXL's own READ and UCX's perftest get, nothing of ours around them.
- `in_place.py`: items held where they lie against items copied into the pool.
- `gpu_path.py`: the copies a worker makes around a transport on a GPU host (CUDA).
- `soak.py`: 2,000 pulls with a producer killed and one frozen.
"""
