"""The batching encoder pool: an alternative to a vLLM encoder instance that batches encoder
work across requests and publishes embeddings a vLLM EPDConnector consumer loads as its own.

Modules: config (PoolConfig), media (door checks, OOM shrink), models (LLaVA vision tower +
projector), batching (queues, batching, dispatch, failures), lifecycle (feature states,
budget), publish (transport + ec_transfer_params), metrics (Prometheus), server (HTTP,
`epd encoder`; items that fail are reported, and the gateway sends them raw).
"""
