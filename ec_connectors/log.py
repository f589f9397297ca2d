"""Loggers under vLLM's `vllm` logger.

Loggers under vLLM's `vllm` logger, so connector messages appear in vLLM's log stream
with its format and level (VLLM_LOGGING_LEVEL)."""

import logging


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"vllm.epd.{name}")
