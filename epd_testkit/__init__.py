"""What tests and benchmarks start around the product: not part of the wheel.

Drivers and fakes that the test suite and `benchmarks/` run beside the real processes. No
module of `ec_connectors`, `scheduler_hooks`, `encoder_service` or `epd_common` imports this
package (tests/test_layout.py checks it), and pyproject.toml's package list leaves it out,
so an installed `epd-serve` holds none of it. Run from a clone (the repository root on the
path, as pytest and `python -m benchmarks...` have it).

- `peer_process.py`: one transport peer (a producer or consumer `Transport`) in a process of
  its own, driven by JSON lines over stdin (`PeerClient` starts and drives one).
- `conformance.py`: the differential conformance harness's cases (seeded requests over every
  modality), the comparison of two answers and `CuttingProxy` (streams broken off
  mid-answer); `benchmarks/serving/conformance.py` runs it against whole stacks.
- `trace_sink.py`: a minimal OTLP/HTTP trace receiver (`python -m epd_testkit.trace_sink
  --port 4318` prints one line per span).
"""
