"""Same-host shared-memory transport.

Same-host shared memory: producers write each item once into their own pre-faulted
arena, consumers copy it once into warm memory, verifying while they copy.

- layout.py: the directory, records and the checks that make reading them safe (torch-free);
- ../hashed_copy.py: the one-pass chunked copy + keyed hash on several threads (shared
  with the peer transports);
- arena.py: a producer's arena (blocks, generations, range locks, liveness), consumers'
  mappings; which block makes room is the lease book's (../leases.py, shared with
  mooncake_te's producer pool);
- transport.py: ShmTransport, the Transport interface over them.
File names (`<key>.item`, `.failed`, `.tmp-`) are ec_connectors/protocol/stored.py's,
which the gateway reads too.
Nothing is imported here, so the torch-free parts stay importable without torch.
"""
