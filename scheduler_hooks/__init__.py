"""Logic that runs in vLLM's scheduler (EngineCore) process: availability index, readiness
and deferral, failure decisions, request params."""
