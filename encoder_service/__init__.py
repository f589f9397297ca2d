"""Encoder service: what the `epd` command runs.

What the `epd` command runs, one subpackage per kind of process: `gateway/` (the
OpenAI-compatible endpoint routing requests to encoders and prefill/decode instances),
`encoder_pool/` (`epd encoder`: the batching encoder server), `local/` (`epd up`, the demo,
process management, test models). `cli.py` dispatches; `bench.py` is `epd bench serve`."""
