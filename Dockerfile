# syntax=docker/dockerfile:1
# One image for the API and the GPU worker. The API uses the CPU torch wheel (the default); the worker
# is built with the CUDA wheel index instead, e.g. (docker-compose.yml does this for `worker`):
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t zenflow-worker .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ZENFLOW_DATA_DIR=/data \
    ZENFLOW_API_HOST=0.0.0.0 \
    ZENFLOW_API_PORT=8000 \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions

# g++/ninja build the C++ CPU optimizer (torch cpp_extension) once, at image build time below.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential curl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first, from the chosen index, so that the dependency resolution below never swaps it.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
COPY . .
RUN pip install .
# Pre-build the C++ optimizer into the image's extension cache (the worker falls back to a JIT build).
RUN python -c "from offload.cpu_adam import load_extension; load_extension()" \
    || echo "C++ optimizer not pre-built; it is compiled on first use"

RUN useradd --create-home --uid 1000 zenflow \
    && mkdir -p /data "${TORCH_EXTENSIONS_DIR}" \
    && chown -R zenflow /data "${TORCH_EXTENSIONS_DIR}"
USER zenflow
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=5 \
    CMD curl -fsS http://127.0.0.1:8000/readyz || exit 1

# The API (migrates the database on start). The worker overrides the command (docker-compose.yml).
CMD ["zenflow", "serve", "--host", "0.0.0.0", "--port", "8000"]
