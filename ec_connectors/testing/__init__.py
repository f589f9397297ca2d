"""Testing: drivers for tests and benchmarks, not used by the connector.

Test and benchmark drivers (not used by the connector itself): `peer_process.py` runs one
transport peer in a process of its own, driven over stdin."""
