"""What the gateway calls: encoders, prefill instances and decode instances.

- `routing.py`: rendezvous hashing with bounded loads (pure).
- `encoder_clients.py`: encoder clients (vLLM producers, `epd encoder` pools) and the router
  that gives each item one encode; `coalescing.py`: new images of concurrent requests in one
  vLLM encoder call, and the maker of each encoder's client; `encoder_progress.py`: the
  deadline of a call queued behind others on one encoder.
- `decoders.py`: the prefill/decode instances, their in-flight counts and cooldowns;
  `http1.py`: the lean HTTP/1.1 client it calls them with.
- `kv_handoff.py`: E/P/D, the prefill hop whose KV cache a decode instance loads.
- `failover.py` (pure) + `resume.py` (I/O): a broken stream continued on another instance.
- `probes.py`: health probes with a real forward; `outages.py`: instances a supervisor
  (`epd up`) reports down and back.
- `availability.py`: items already stored somewhere (skip their encode).
- `fleet.py`: every pool as one fleet: what to probe, what a failed probe does.
"""
