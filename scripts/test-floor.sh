#!/usr/bin/env bash
# The engine's tests (tests/offload, fast ones) on the lowest torch pyproject.toml allows: its floor
# ("torch>=X.Y" -> torch==X.Y.0), which is what the lent GPU machines run (2.11), in a second venv,
# .venv-floor, beside .venv (same Python). Idempotent: the venv is rebuilt only when pyproject.toml or
# the floor changes. The repo is imported from the source tree (PYTHONPATH), not installed, so the
# C++ optimizer built for .venv's torch is never replaced; the floor's torch gets its own build.
#
# The package index this project's machines reach has CPU builds of the pinned torch only; the floor
# release comes from PyPI, whose Linux wheel is the CUDA build (it runs on a CPU; about 3 GB with its
# NVIDIA libraries, installed once). ZENFLOW_FLOOR_TORCH_SPEC overrides the spec (e.g. a CPU wheel's
# path or "torch==2.11.0+cpu" with an index that has it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-floor
LOG=$VENV.log
floor=$(.venv/bin/python - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
spec = next(d for d in deps if re.match(r"torch\s*>=", d))
v = re.search(r">=\s*([0-9.]+)", spec).group(1)
print(v if v.count(".") == 2 else v + ".0")
PY
)
spec=${ZENFLOW_FLOOR_TORCH_SPEC:-torch==$floor}
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $spec"
stamp=$VENV/.zenflow-floor
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  t=$(date +%s)
  rm -rf "$VENV"
  "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv "$VENV"
  pip() { "$VENV/bin/python" -m pip install -q --no-compile --disable-pip-version-check --no-input "$@" >>"$LOG" 2>&1; }
  # the project's own requirements, torch replaced by the floor, plus the test runner
  mapfile -t deps < <(.venv/bin/python -c '
import re, tomllib
for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if not re.match(r"torch\s*>=", d):
        print(d)')
  if ! pip "$spec" "${deps[@]}" pytest pytest-timeout pytest-xdist; then
    echo "test-floor: could not install $spec and the requirements; the end of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
  echo "$want" >"$stamp"
  echo "test-floor: $VENV with $spec in $(( $(date +%s) - t )) s" >&2
fi
echo "test-floor: tests/offload on $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)')" >&2
# the installed build in the tree is for .venv's torch: the floor compiles its own (JIT, tagged by every input)
ZENFLOW_CPU_ADAM_JIT=1 PYTHONPATH=$PWD exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q \
  -n "${ZENFLOW_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder -m "not slow" tests/offload "$@"
