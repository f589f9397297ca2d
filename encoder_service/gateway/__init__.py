"""The EPD gateway: one OpenAI-compatible endpoint in front of encoders and prefill/decode
instances. See app.py for the request path, config.py for every setting."""

from encoder_service.gateway.app import create_app
from encoder_service.gateway.config import GatewayConfig, GatewayConfigError

__all__ = ["GatewayConfig", "GatewayConfigError", "create_app"]
