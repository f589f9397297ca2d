#!/usr/bin/env bash
# The two commands of the README. Both run the idempotent setup first.
#   ./run.sh demo   epd up --demo: vLLM encoder + vLLM prefill/decode + gateway; one image request through the gateway
#   ./run.sh test   the whole test suite (lint, unit, real Mooncake/vLLM end-to-end)
set -euo pipefail
cd "$(dirname "$0")"
python3 scripts/setup_env.py
case "${1:-}" in
  demo) shift; exec .venv/bin/epd up --demo "$@" ;;
  test)
    shift
    .venv/bin/ruff check .
    exec .venv/bin/python -m pytest -q -rs "$@" ;;
  *) echo "usage: $0 demo|test [args...]" >&2; exit 2 ;;
esac
