"""The batching encoder pool: an alternative to a vLLM encoder instance that batches encoder
work across requests and publishes embeddings a vLLM EPDConnector consumer loads as its own.

Modules: config (PoolConfig), media (door checks, OOM shrink), encoders (LLaVA vision tower +
projector), pool (queues, batching, dispatch, failures), lifecycle (feature states, budgets),
merge (position maps, vectorized merge), publish (transport + ec_transfer_params),
fallback (text-only requests), metrics (Prometheus), server (HTTP, `epd encoder`).
"""
