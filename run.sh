#!/usr/bin/env bash
# The two commands of the README. Both run the idempotent setup first.
#   ./run.sh demo   epd up --demo: vLLM encoder + vLLM prefill/decode + gateway; one image request through the gateway
#   ./run.sh test   lint, then the whole test suite: the fast lane (no vLLM servers) on three
#                   workers, then the end-to-end tests (real `vllm serve` processes) one at a time
#                   (at the end, per lane: its time, vLLM server starts, slowest set-ups)
#   ./run.sh fast   lint + the fast lane only (tests marked e2e are left out)
#   ./run.sh test ARGS...   lint + pytest ARGS (one process), e.g. -m "not e2e" or a test path
#   ./run.sh test-deploy    the deploy lane (tests/deploy, marker deploy; docs/deploy.md): installs
#                   podman + podman-compose when missing (apt, as root), builds the base and the
#                   image (cached), then, under the machine's vLLM lock, runs docker-compose.yml
#                   and checks it through the gateway; removes every container, network and
#                   volume it made, and fails if one is left
#   ./run.sh test-compat    the version lane (tests/compat, marker compat; docs/compatibility.md):
#                   vLLM 0.32 (.venv), 0.33.0 and 0.34.0 (GPU wheels in side environments under
#                   .work/compat, made once): API surface, plugin, both roles, unit subset
#   ./run.sh gpu-wheels     the wheels `gpu-check` installs, into .work/gpu-wheels (network)
#   ./run.sh gpu-check      on an NVIDIA GPU machine (PyTorch, no vLLM, no network): installs
#                   .work/gpu-wheels, runs the CUDA tests and the GPU path benchmark; "no GPU"
#                   and exit 0 elsewhere
set -euo pipefail
cd "$(dirname "$0")"
# a GPU machine has no network: no setup there, only the carried wheels (scripts/gpu_check.py)
if [ "${1:-}" = gpu-check ]; then shift; exec python3 scripts/gpu_check.py "$@"; fi
python3 scripts/setup_env.py
# Python's bytecode caches (__pycache__, git-ignored) even where the environment turns them
# off: without them every process recompiles the project's modules and every pytest worker
# rewrites every test module again (docs/testing.md)
unset PYTHONDONTWRITEBYTECODE
PYTEST=(.venv/bin/python -m pytest -q -rs)
FAST=(-m "not e2e and not compat" -n 3 --dist loadfile)  # one module per worker; ports: tests/helpers.py PORT_BLOCKS
case "${1:-}" in
  demo) shift; exec .venv/bin/epd up --demo "$@" ;;
  test)
    shift
    .venv/bin/ruff check .
    if [ $# -gt 0 ]; then exec "${PYTEST[@]}" "$@"; fi
    # the e2e lane's caches warm (tests/prewarm.py) beside the fast lane, niced below it
    mkdir -p .work
    nice -n 19 .venv/bin/python -m tests.prewarm >.work/prewarm.log 2>&1 &
    warm=$!
    trap 'kill $warm 2>/dev/null || true' EXIT
    rc=0
    "${PYTEST[@]}" "${FAST[@]}" || rc=$?
    wait $warm || echo "prewarm left a cache cold (.work/prewarm.log); the e2e lane warms it"
    trap - EXIT
    if [ $rc -eq 0 ]; then "${PYTEST[@]}" -m e2e --durations=12 || rc=$?; fi
    # each lane's time, vLLM server starts (limit: tests/lanes.py) and slowest set-ups
    .venv/bin/python -m tests.lanes fast e2e || rc=1
    exit $rc ;;
  fast) shift; .venv/bin/ruff check .; exec "${PYTEST[@]}" "${FAST[@]}" "$@" ;;
  test-deploy)
    shift
    .venv/bin/python -m tests.deploy.engine prepare  # builds first: no vLLM, no lock
    rc=0
    flock /tmp/epd-vllm.lock "${PYTEST[@]}" -m deploy tests/deploy "$@" || rc=$?
    .venv/bin/python -m tests.deploy.engine clean || rc=1  # even after a failure; checks
    exit $rc ;;
  gpu-wheels) shift; exec .venv/bin/python scripts/gpu_check.py --fetch "$@" ;;
  test-compat)
    shift
    .venv/bin/ruff check .
    exec python3 scripts/compat.py "$@" ;;
  *) echo "usage: $0 demo|test|fast|test-deploy|test-compat|gpu-wheels|gpu-check [args...]" >&2; exit 2 ;;
esac
