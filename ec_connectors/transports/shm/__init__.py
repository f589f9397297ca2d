"""Same-host shared memory: producers write each item once into their own pre-faulted
arena, consumers copy it once into warm memory, verifying while they copy.

- layout.py: the directory, records and the checks that make reading them safe (torch-free);
- copy.py: the one-pass chunked copy + keyed hash on several threads (torch-free);
- arena.py: a producer's arena (blocks, leases, eviction, liveness), consumers' mappings;
- transport.py: ShmTransport, the Transport interface over them.
Nothing is imported here, so the torch-free parts stay importable without torch.
"""
