#!/usr/bin/env bash
# Idempotent set-up: .venv, the pinned CPU torch first (a bare torch pulls a CUDA build), then the
# package with its dev extras, which builds the C++ CPU optimizer into offload/_ext/ (setup.py; the
# jobs load that build and never compile, offload/cpu_adam_build.py).
# Quiet: one progress line per stage that does work, with its time; what pip, the compiler and
# apt-get print goes to .venv/bootstrap.log, shown (its tail) when a stage fails. Already done, it
# prints nothing and takes well under a second (stamps in .venv).
# `--test-tools` (make test and its kin) also installs, as root, the Debian tools only the tests use
# (prometheus, nginx, chromium); `make run` and `make lint` never install them.
set -euo pipefail
test_tools=0
[ "${1:-}" = "--test-tools" ] && test_tools=1
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
TORCH_SPEC=${ZENFLOW_TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.zenflow-bootstrap
ext_stamp=.venv/.zenflow-cpu-adam
LOG=.venv/bootstrap.log
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $TORCH_SPEC"
t_all=$(date +%s.%N)

elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# stage NAME CMD...: run CMD with its output in $LOG, then say "bootstrap: NAME (N.N s)"; on failure
# the log's tail and exit 1.
stage() {
  local name=$1 t
  shift
  t=$(date +%s.%N)
  if [ -t 2 ]; then printf 'bootstrap: %s ...\r' "$name" >&2; fi
  echo "==> $(date -u +%FT%TZ) $name: $*" >>"$LOG"
  if "$@" >>"$LOG" 2>&1; then
    printf 'bootstrap: %-52s %6s s\n' "$name" "$(elapsed "$t")" >&2
  else
    printf 'bootstrap: %s FAILED after %s s; the end of %s:\n' "$name" "$(elapsed "$t")" "$LOG" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}

if [ ! -x .venv/bin/python ]; then
  t=$(date +%s.%N)
  "$PY" -m venv .venv
  printf 'bootstrap: %-52s %6s s\n' "virtual environment .venv ($("$PY" --version 2>&1))" "$(elapsed "$t")" >&2
fi
: >>"$LOG"

# --no-compile: no byte-compiling of every installed module (torch's thousands) at install time;
# Python compiles the ones a command imports, once, when it first imports them.
pip_install() { .venv/bin/python -m pip install -q --no-compile --disable-pip-version-check --no-input "$@"; }
# --no-build-isolation: setup.py builds the C++ optimizer against this venv's torch (an isolated build
# has no torch); "require": a missing compiler or ninja fails the stage instead of skipping the build.
pip_install_project() { ZENFLOW_CPU_ADAM_BUILD=require pip_install --no-build-isolation "$@"; }

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  stage "pip, setuptools, wheel, ninja" pip_install --upgrade pip setuptools wheel ninja
  stage "$TORCH_SPEC (CPU build)" pip_install "$TORCH_SPEC"
  stage "zenflow, dev extras, C++ optimizer (pip install -e .[dev])" pip_install_project -e '.[dev]'
  echo "$want" >"$stamp"
fi

# Rebuild the C++ optimizer when its sources or build code changed since (a no-op when the build in
# offload/_ext/ is up to date); skipped, without starting Python, while they and the stamp are unchanged.
if [ -f offload/cpu_adam_build.py ]; then
  ext_want="$(cat offload/cpu_adam_build.py setup.py offload/csrc/* 2>/dev/null | sha256sum | cut -d' ' -f1) $want $(pwd)"
  if [ "$(cat "$ext_stamp" 2>/dev/null)" != "$ext_want" ]; then
    stage "C++ CPU optimizer (build if stale)" .venv/bin/python -m offload.cpu_adam_build
    echo "$ext_want" >"$ext_stamp"
  fi
fi

apt_install() {  # apt_install PKG...: install, after an update when the first try fails
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "$@" \
    || { apt-get update -q && apt-get install -y -q --no-install-recommends "$@"; }
}
as_root_with_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
optional() {  # optional NAME WHAT-SKIPS CMD...: a stage whose failure only skips some tests
  local name=$1 skips=$2 t
  shift 2
  t=$(date +%s.%N)
  echo "==> $(date -u +%FT%TZ) $name: $*" >>"$LOG"
  if "$@" >>"$LOG" 2>&1; then
    printf 'bootstrap: %-52s %6s s\n' "$name" "$(elapsed "$t")" >&2
  else
    echo "bootstrap: could not install $name (apt-get, see $LOG); $skips will skip" >&2
  fi
}

# Prometheus from Debian (prometheus + promtool) for tests/observability: installed only when missing,
# only as root with apt-get; without it those tests skip and say why.
if [ "$test_tools" = 1 ] && ! { command -v prometheus && command -v promtool; } >/dev/null 2>&1 && as_root_with_apt; then
  optional "prometheus (apt-get)" "tests/observability" apt_install prometheus
fi
# nginx from Debian (nginx-light) for tests/api/test_proxy.py, which runs the compose deployment's proxy
# config (deploy/nginx) in front of the API: installed only when missing, only as root with apt-get
# (the package's own service start is refused in containers; the tests run their own nginx).
nginx_install() {  # nginx-light where Debian still has it (bookworm), else nginx
  apt_install nginx-light || apt_install nginx
}
if [ "$test_tools" = 1 ] && ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ] && as_root_with_apt; then
  optional "nginx (apt-get)" "tests/api/test_proxy.py" nginx_install
fi
# Chromium from Debian for tests/console (Playwright drives /usr/bin/chromium; `playwright install` is
# never run), with fonts-liberation so its screenshots have legible text: installed only when missing,
# only as root with apt-get; without it those tests skip locally and fail in CI.
if [ "$test_tools" = 1 ] && [ ! -x /usr/bin/chromium ] && as_root_with_apt; then
  optional "chromium (apt-get)" "tests/console" apt_install chromium fonts-liberation
fi

# WordNet for the meteor metric of the text_similarity grader: Debian's wordnet-base and
# wordnet-sense-index (installed only when missing, only as root with apt-get) laid out where NLTK looks
# (scripts/wordnet_layout.sh, which the Dockerfile runs too). Without it meteor is refused with a clear error.
wordnet_dir=.venv/share/nltk_data/corpora/wordnet
wordnet_layout() {
  if [ ! -f /usr/share/wordnet/index.sense ]; then apt_install wordnet-base wordnet-sense-index; fi
  bash scripts/wordnet_layout.sh .venv/share/nltk_data
}
if [ ! -s "$wordnet_dir/lexnames" ] && { [ -f /usr/share/wordnet/index.sense ] || as_root_with_apt; }; then
  optional "WordNet for meteor (wordnet-base)" "the meteor metric and its tests" wordnet_layout
fi

if awk -v a="$t_all" -v b="$(date +%s.%N)" 'BEGIN { exit !(b - a >= 1) }'; then
  printf 'bootstrap: %-52s %6s s (log: %s)\n' "done" "$(elapsed "$t_all")" "$LOG" >&2
fi
