#!/usr/bin/env bash
# Idempotent set-up: .venv, the pinned CPU torch first (a bare torch pulls a CUDA build), then the
# package with its dev extras, then the C++ CPU optimizer build (cached by torch's extension cache).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
TORCH_SPEC=${ZENFLOW_TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.zenflow-bootstrap
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $TORCH_SPEC"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
  .venv/bin/python -m pip install -q -e '.[dev]'
  echo "$want" > "$stamp"
fi
# Build (or load from cache) the C++ optimizer once so the first job does not pay for it.
if [ -f offload/cpu_adam.py ]; then
  .venv/bin/python -c "from offload.cpu_adam import load_extension; load_extension()"
fi
# Prometheus from Debian (prometheus + promtool) for tests/observability: installed only when missing,
# only as root with apt-get; without it those tests skip and say why.
if ! { command -v prometheus && command -v promtool; } >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 \
         && apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; } \
    || echo "bootstrap: could not install prometheus (apt-get); its tests will skip" >&2
fi
# nginx from Debian (nginx-light) for tests/api/test_proxy.py, which runs the compose deployment's proxy
# config (deploy/nginx) in front of the API: installed only when missing, only as root with apt-get
# (the package's own service start is refused in containers; the tests run their own nginx).
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ] \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  nginx_install() {  # nginx-light where Debian still has it (bookworm), else nginx
    apt-get install -y -q --no-install-recommends nginx-light >/dev/null 2>&1 \
      || apt-get install -y -q --no-install-recommends nginx >/dev/null 2>&1
  }
  nginx_install || { apt-get update -q >/dev/null 2>&1 && nginx_install; } \
    || echo "bootstrap: could not install nginx (apt-get); tests/api/test_proxy.py will skip" >&2
fi
# Chromium from Debian for tests/console (Playwright drives /usr/bin/chromium; `playwright install` is
# never run), with fonts-liberation so its screenshots have legible text: installed only when missing,
# only as root with apt-get; without it those tests skip locally and fail in CI.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends chromium fonts-liberation >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 \
         && apt-get install -y -q --no-install-recommends chromium fonts-liberation >/dev/null 2>&1; } \
    || echo "bootstrap: could not install chromium (apt-get); tests/console will skip" >&2
fi
