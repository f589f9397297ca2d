#!/usr/bin/env bash
# The two commands of the README. Both run the idempotent setup first.
#   ./run.sh demo   start an EPD pair (vLLM encoder -> vLLM prefill/decode) and answer one image request
#   ./run.sh test   the whole test suite (lint, unit, real Mooncake/vLLM end-to-end)
set -euo pipefail
cd "$(dirname "$0")"
python3 scripts/setup_env.py
case "${1:-}" in
  demo) shift; exec .venv/bin/epd demo "$@" ;;
  test)
    shift
    .venv/bin/ruff check .
    exec .venv/bin/python -m pytest -q -rs "$@" ;;
  *) echo "usage: $0 demo|test [args...]" >&2; exit 2 ;;
esac
