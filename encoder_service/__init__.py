"""Encoder service: launcher, demo, test model, vLLM CLI shim (the pool and gateway come next)."""
