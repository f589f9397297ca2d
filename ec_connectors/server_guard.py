"""The stable import path of the server guard for vLLM's `--middleware`.

`vllm serve ... --middleware ec_connectors.server_guard.ServerGuard`: the name users pass to
vLLM (every server `epd up`, compose and k8s start). The guard lives in `guard/`; this module
only keeps that path stable."""

from ec_connectors.guard.server_guard import ServerGuard

__all__ = ["ServerGuard"]
