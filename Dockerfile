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
    ZENFLOW_API_PORT=8000

# g++ builds the C++ CPU optimizer once, at `pip install` below (setup.py); jobs load that build and
# never compile (offload/cpu_adam_build.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential curl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first, from the chosen index, so that the dependency resolution below never swaps it; the
# build tools too, because the install below builds against that torch without build isolation.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}" \
    && pip install "setuptools>=68" wheel "ninja>=1.11"
COPY . .
# WordNet for the meteor metric of the text_similarity grader (trainer/graders/wordnet.py): Debian's
# wordnet-base laid out where NLTK looks (the lexnames table comes from its man page, which the slim
# image's dpkg excludes unless included by name).
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        -o Dpkg::Options::="--path-include=/usr/share/man/man5/lexnames.5WN.gz" \
        wordnet-base wordnet-sense-index \
    && rm -rf /var/lib/apt/lists/* \
    && bash scripts/wordnet_layout.sh /usr/local/share/nltk_data
# The C++ optimizer is compiled for a portable target, x86-64-v3 (AVX2, FMA: Intel Haswell and AMD Zen
# onwards, every GPU server of the last decade), so an image built on one CPU runs on another; a host
# lacking those instructions refuses the build at job start with a message naming them (never an
# illegal instruction). Opt in to more: --build-arg CPU_ADAM_ARCH=-march=x86-64-v4 (AVX-512: Sapphire
# Rapids, Zen 4) or -march=native (the building CPU's own; then only hosts with its features run it);
# an Arm image: -march=armv8.2-a. Kept in the image's environment: an input of the build, checked on load.
ARG CPU_ADAM_ARCH=-march=x86-64-v3
ENV ZENFLOW_CPU_ADAM_ARCH=${CPU_ADAM_ARCH}
# Editable, so that the one copy of the code in /app, which the job processes import (`python -m`
# from the working directory /app puts it first on sys.path), is the installed one and carries the
# build (offload/_ext/); --check fails the image if it cannot be loaded.
# The app's own modules are byte-compiled here (pip compiles the installed packages, not an editable
# project's): PYTHONDONTWRITEBYTECODE and a read-only /app mean a job process could never cache them.
RUN ZENFLOW_CPU_ADAM_BUILD=require pip install --no-build-isolation -e . \
    && python -m offload.cpu_adam_build --check \
    && python -m compileall -q api contract demo offload serving store trainer worker

# /zenflow-targets: where `python -m worker` writes its /metrics endpoints for Prometheus (compose's
# `worker-targets` volume, which takes this folder's owner when it is first mounted).
RUN useradd --create-home --uid 1000 zenflow \
    && mkdir -p /data /zenflow-targets \
    && chown -R zenflow /data /zenflow-targets
USER zenflow
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=5 \
    CMD curl -fsS http://127.0.0.1:8000/readyz || exit 1

# The API (migrates the database on start). The worker overrides the command (docker-compose.yml).
CMD ["zenflow", "serve", "--host", "0.0.0.0", "--port", "8000"]
