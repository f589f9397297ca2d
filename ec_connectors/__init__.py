"""vLLM encoder-cache connectors (EPDConnector) and their transports."""

__version__ = "0.1.0"
