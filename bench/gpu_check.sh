#!/usr/bin/env bash
# GPU check of the ZenFlow engine: one command on a lent GPU machine, as it comes (no network, its own
# Python and torch), ending within DEADLINE seconds (default 520, under the 9 minutes a check may take).
#
# Order (the headline first, so a run cut short keeps what matters most; every section is bounded by the
# one deadline and a failed section never stops the next):
#  0. preflight: every prerequisite checked and listed (Python with torch, CUDA, the engine's packages,
#     the compiler for the C++ optimizer, NVML, matplotlib), missing Python packages installed from the
#     carried wheels in .whl/ -> preflight.json. Then it goes on with what it has.
#  1. the C++ CPU optimizer built as an install builds it (python -m offload.cpu_adam_build) and loaded; if it cannot be, the run says why and measures the rest
#     (device mode only in the headline; the sections that need it are skipped with that reason).
#  2. HEADLINE: bench/engine.py on a ~1.1B Llama (TinyLlama-1.1B shape, bf16, random init), batch 8 x 2048,
#     zenflow / device / offload (offload fewer steps; zenflow-dacc after, if time is left): steps/s,
#     stall fraction, GPU utilization from NVML, held-out loss vs device -> gpu_check.json; the headline
#     table and ratios are printed as soon as it ends.
#  3. bench/distributed.py with NCCL ranks (only with 2 or more GPUs) -> distributed.json
#  4. bench/engine_ops.py, bf16: host syncs and launches per step, reselection, bad gradients -> engine_ops_bf16.json
#  5. bench/engine_ops.py, fp16 loss scaling, a reselection every window -> engine_ops_fp16.json
#  6. bench/engine.py, small: the CPU worker's GIL hold per step -> gil_small.json
#  7. bench/cpu_adam.py: the C++ AdamW and window accumulation against torch's on this host -> cpu_adam.json
#  8. bench/memory.py --run: the plan's step time and memory against a short real run -> memory_run.json
#  9. bench/gpu_report.py: every section in one JSON (gpu_check_summary.json) and a chart (gpu_check.png)
#
# Usage
#   bash bench/gpu_check.sh                 # on the GPU machine, from anywhere in the repo
#   bash bench/gpu_check.sh --fetch-wheels  # where pip can reach the package index, before: the cp312
#                                           # wheels of the packages the GPU image lacks, into .whl/
#                                           # (git-ignored); name .whl in the device call's carry
#   DEVICE=cpu bash bench/gpu_check.sh      # the same pipeline on the CPU, small sizes (tests run it)
# Environment (defaults below): DEVICE, MODEL_SIZE, STEPS, OFFLOAD_STEPS, WARMUP, BATCH, SEQ, MODES,
# EXTRA_MODES, CORES_RATIO, TOPK, UPDATE_INTERVAL, DEADLINE, HEADLINE_TIMEOUT, OPS_MODEL_SIZE, OPS_STEPS,
# OPS_PROFILE_STEPS, GIL_MODEL_SIZE, GIL_STEPS, ADAM_PARAMS, DIST_MODEL, DIST_STEPS, DIST_TIMEOUT,
# DIST_NPROC, TIME_SCALE (every section's own time limit times this: a slow or loaded machine), PY (the
# Python to use).
# Output: OUT (set by the device runner; else runs/gpu_check) receives three files, refreshed after every
# section so a run cut short keeps what finished: gpu_check_summary.json (every section's document),
# gpu_check.png (the headline chart, at the end) and gpu_check_logs.tar.gz (each section's JSON and log).
# The sections write into WORK (default: a fresh folder under /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHL="$ROOT/.whl"
# What the engine and the benches import that the GPU image lacks (KINDS.md's package list): pydantic
# (offload.config) and its own requirements. Pinned: one version of each, cp312 manylinux wheels.
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p "$WHL"
  if [ -d .git ] && ! grep -qx '/.whl/' .git/info/exclude 2>/dev/null; then echo '/.whl/' >> .git/info/exclude; fi
  py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHL" "${WHEELS[@]}" || exit 1
  ls -l "$WHL"
  exit 0
fi

DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cpu ]; then  # the pipeline on a CPU: small enough for a 2-core box
  : "${MODEL_SIZE:=small}" "${STEPS:=6}" "${OFFLOAD_STEPS:=4}" "${WARMUP:=1}" "${BATCH:=4}" "${SEQ:=64}"
  : "${OPS_MODEL_SIZE:=tiny}" "${OPS_STEPS:=8}" "${OPS_PROFILE_STEPS:=4}" "${GIL_MODEL_SIZE:=tiny}" "${GIL_STEPS:=4}"
  : "${ADAM_PARAMS:=2000000}" "${EXTRA_MODES:=}"
fi
MODEL_SIZE=${MODEL_SIZE:-1b}
STEPS=${STEPS:-30}
OFFLOAD_STEPS=${OFFLOAD_STEPS:-6}
WARMUP=${WARMUP:-3}
BATCH=${BATCH:-8}
SEQ=${SEQ:-2048}
MODES=${MODES:-zenflow,device,offload}
EXTRA_MODES=${EXTRA_MODES-zenflow-dacc}
CORES_RATIO=${CORES_RATIO:-0.75}
TOPK=${TOPK:-0.1}
UPDATE_INTERVAL=${UPDATE_INTERVAL:-4}
DEADLINE=${DEADLINE:-520}
TIME_SCALE=${TIME_SCALE:-1}
HEADLINE_TIMEOUT=${HEADLINE_TIMEOUT:-260}
OPS_MODEL_SIZE=${OPS_MODEL_SIZE:-deep}
OPS_STEPS=${OPS_STEPS:-24}
OPS_PROFILE_STEPS=${OPS_PROFILE_STEPS:-16}
GIL_MODEL_SIZE=${GIL_MODEL_SIZE:-small}
GIL_STEPS=${GIL_STEPS:-30}
ADAM_PARAMS=${ADAM_PARAMS:-64000000}
DIST_MODEL=${DIST_MODEL:-medium}
DIST_STEPS=${DIST_STEPS:-20}
DIST_TIMEOUT=${DIST_TIMEOUT:-180}
DIST_NPROC=${DIST_NPROC:-}
T_START=$(date +%s)
OUTDIR=${OUT:-$ROOT/runs/gpu_check}
mkdir -p "$OUTDIR"
rm -f "$OUTDIR"/gpu_check_summary.json "$OUTDIR"/gpu_check.png "$OUTDIR"/gpu_check_logs.tar.gz
WORK=${WORK:-$(mktemp -d /tmp/zf-gpu-check.XXXXXX)}
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
elapsed() { echo $(( $(date +%s) - T_START )); }
# a step's time limit (seconds, times TIME_SCALE), cut to what is left before DEADLINE
left() { local want=$(( $1 * TIME_SCALE )) l=$(( DEADLINE - $(elapsed) )); [ "$l" -lt "$want" ] && echo "$l" || echo "$want"; }
publish() {  # the summary so far and the sections' files, into OUTDIR
  "$PY" -m bench.gpu_report --out "$WORK" --quiet --no-chart >/dev/null 2>&1 || true
  copy_out
}
copy_out() {
  for f in gpu_check_summary.json gpu_check.png; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUTDIR/$f"; done
  tar czf "$OUTDIR/gpu_check_logs.tar.gz" -C "$WORK" --exclude gpu_check_summary.json --exclude gpu_check.png . 2>/dev/null || true
}

# --- 0. preflight ----------------------------------------------------------------------------------
echo "== preflight"
MISSING=()
want_cuda=1; [ "$DEVICE" = cpu ] && want_cuda=0
PY=${PY:-}
if [ -z "$PY" ]; then
  for cand in python3 "$ROOT/.venv/bin/python" python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import sys, torch; sys.exit(0 if $want_cuda == 0 or torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
      PY=$(command -v "$cand"); break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "preflight: no Python with a torch that sees a GPU (DEVICE=$DEVICE): this check needs a CUDA machine (or DEVICE=cpu)" >&2
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi || echo "preflight: nvidia-smi not found" >&2
  exit 2
fi
if ! "$PY" -c 'import pydantic' >/dev/null 2>&1; then
  if ls "$WHL"/*.whl >/dev/null 2>&1; then
    echo "installing the carried wheels: $(cd "$WHL" && ls *.whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/zf-site \
      "$WHL"/*.whl || MISSING+=("wheels in .whl/ did not install")
    export PYTHONPATH=/tmp/zf-site${PYTHONPATH:+:$PYTHONPATH}
  else
    MISSING+=("pydantic (no wheels in .whl/: run 'bash bench/gpu_check.sh --fetch-wheels' where pip works, carry .whl)")
  fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
PREFLIGHT_MISSING=$(printf '%s\n' "${MISSING[@]+"${MISSING[@]}"}") "$PY" - "$WORK/preflight.json" "$DEVICE" <<'EOF'
import importlib, json, os, platform, shutil, subprocess, sys
out, device = sys.argv[1], sys.argv[2]
missing = [m for m in os.environ.get("PREFLIGHT_MISSING", "").splitlines() if m]
found = {"python": platform.python_version()}
def need(mod, why, required=True):
    try:
        m = importlib.import_module(mod)
        found[mod] = getattr(m, "__version__", getattr(m, "VERSION", "present"))
    except Exception as e:
        (missing if required else optional).append(f"{mod} ({why}): {type(e).__name__}: {e}")
optional = []
for mod, why in [("torch", "everything"), ("pydantic", "offload.config"), ("transformers", "the benches' Llama"),
                 ("numpy", "torch, benches"), ("safetensors", "checkpoints")]:
    need(mod, why)
need("pynvml", "GPU utilization from NVML (nvidia-ml-py)", required=device != "cpu")
need("matplotlib", "the PNG chart", required=False)
need("ninja", "the C++ optimizer's JIT build", required=False)
for tool, why in [("g++", "the C++ optimizer's build"), ("ninja", "the C++ optimizer's JIT build")]:
    (found.__setitem__(tool, shutil.which(tool)) if shutil.which(tool) else missing.append(f"{tool} ({why}) not on PATH"))
try:
    import torch
    found["torch_cuda"] = torch.version.cuda
    found["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        found["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}"
        found["gpu_count"] = torch.cuda.device_count()
    elif device != "cpu":
        missing.append("a CUDA device visible to torch")
    floor = (2, 11)
    ver = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if ver < floor:
        missing.append(f"torch >= {floor[0]}.{floor[1]} (have {torch.__version__})")
except Exception:
    pass
found["cpu_cores"] = len(os.sched_getaffinity(0))
try:
    found["host_memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
except (ValueError, OSError):
    pass
if shutil.which("nvidia-smi"):
    r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                        "--format=csv,noheader"], capture_output=True, text=True)
    found["nvidia_smi"] = r.stdout.strip()
for k, v in found.items():
    print(f"  {k}: {v}")
for m in missing:
    print(f"  MISSING: {m}")
for m in optional:
    print(f"  optional, missing: {m}")
json.dump({"found": found, "missing": missing, "optional_missing": optional}, open(out, "w"), indent=2)
EOF

# --- 1. the C++ CPU optimizer ----------------------------------------------------------------------
echo "== C++ CPU optimizer (build or load)"
start=$(date +%s)
CPP_OK=1
# The way an install builds it (python -m offload.cpu_adam_build: into offload/_ext of this copy, a no-op
# when up to date), then the load every job does (by path, never compiling).
{ timeout "$(left 240)" "$PY" -m offload.cpu_adam_build \
  && timeout "$(left 60)" "$PY" -c 'from offload.cpu_adam import load_extension, simd_width; load_extension(); print("cpu_adam ready:", simd_width())'
} > "$WORK/cpp_build.log" 2>&1 || CPP_OK=0
tail -n 5 "$WORK/cpp_build.log"
echo "build/load took $(( $(date +%s) - start ))s"
if [ "$CPP_OK" = 0 ]; then
  echo "C++ optimizer unavailable (log above; full log cpp_build.log): measuring device mode only"
  MODES=device; EXTRA_MODES=""
fi

# libgomp affinity variables from the image would override the engine's core placement.
unset OMP_PROC_BIND GOMP_CPU_AFFINITY OMP_PLACES
section() {  # section NAME TIMEOUT JSON_FILE -- command...
  local name=$1 limit; limit=$(left "$2"); local json=$3; shift 4
  if [ "$limit" -le 5 ]; then echo "== $name: skipped (deadline)"; return 0; fi
  echo "== $name (up to ${limit}s, at $(elapsed)s)"
  local rc=0
  timeout "$limit" "$@" > "$WORK/$json.tmp" 2> >(tee "$WORK/${json%.json}.log" >&2) || rc=$?
  if [ "$rc" = 0 ]; then mv "$WORK/$json.tmp" "$WORK/$json"; else
    echo "$name exited with $rc (124: cut at ${limit}s)"; rm -f "$WORK/$json.tmp"; fi
  publish
}
engine() {  # engine MODES TIMEOUT: the headline bench, JSON rewritten after every variant
  local limit; limit=$(left "$2")
  [ "$limit" -le 5 ] && { echo "headline ($1): skipped (deadline)"; return 0; }
  timeout "$limit" "$PY" -m bench.engine --device "$DEVICE" --model-size "$MODEL_SIZE" --modes "$1" \
    --steps "$STEPS" --offload-steps "$OFFLOAD_STEPS" --warmup "$WARMUP" --batch "$BATCH" --seq "$SEQ" \
    --cores-ratio "$CORES_RATIO" --topk-ratio "$TOPK" --update-interval "$UPDATE_INTERVAL" \
    --json-out "$WORK/$3" >> "$WORK/gpu_check.log" 2>&1 || echo "bench/engine.py ($1) exited with $? (124: cut at ${limit}s)"
}

# --- 2. the headline -------------------------------------------------------------------------------
echo "== HEADLINE: bench/engine.py ($MODEL_SIZE, $DEVICE, modes $MODES, up to $(left "$HEADLINE_TIMEOUT")s)"
: > "$WORK/gpu_check.log"
engine "$MODES" "$HEADLINE_TIMEOUT" gpu_check.json
"$PY" -m bench.gpu_report --out "$WORK" --headline || tail -n 20 "$WORK/gpu_check.log"
publish

# --- 3-8. the rest, in the time left ---------------------------------------------------------------
n_gpus=0
[ "$DEVICE" = cuda ] && n_gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$n_gpus" -ge 2 ] && [ "$CPP_OK" = 1 ]; then
  nproc=${DIST_NPROC:-$(( n_gpus < 8 ? n_gpus : 8 ))}
  section "bench/distributed.py: $nproc NCCL ranks vs one process ($DIST_MODEL)" "$DIST_TIMEOUT" distributed.json -- \
    "$PY" -m bench.distributed --nproc "$nproc" --device cuda --model "$DIST_MODEL" --steps "$DIST_STEPS" \
    --warmup 3 --timeout "$(( DIST_TIMEOUT / 2 ))" --json
else
  echo "== bench/distributed.py: skipped ($n_gpus GPU(s) visible with DEVICE=$DEVICE; needs 2 or more)"
fi
if [ "$CPP_OK" = 1 ]; then
  section "bench/engine_ops.py: host syncs, launches, reselection, bad gradients ($OPS_MODEL_SIZE, bf16)" 100 \
    engine_ops_bf16.json -- "$PY" -m bench.engine_ops --device "$DEVICE" --model-size "$OPS_MODEL_SIZE" \
    --modes zenflow,zenflow-dacc --dtype bf16 --steps "$OPS_STEPS" --bad-steps 5,13 \
    --profile-steps "$OPS_PROFILE_STEPS" --cores-ratio "$CORES_RATIO" --json
  section "bench/engine_ops.py: fp16 loss scaling, a reselection every window ($OPS_MODEL_SIZE)" 80 \
    engine_ops_fp16.json -- "$PY" -m bench.engine_ops --device "$DEVICE" --model-size "$OPS_MODEL_SIZE" \
    --modes zenflow --dtype fp16 --select-interval 4 --steps 16 --bad-steps 6 --profile-steps 8 \
    --cores-ratio "$CORES_RATIO" --json
  section "bench/engine.py: the CPU worker's GIL hold per step ($GIL_MODEL_SIZE)" 80 gil_small.json -- \
    "$PY" -m bench.engine --device "$DEVICE" --model-size "$GIL_MODEL_SIZE" --modes zenflow,zenflow-dacc \
    --steps "$GIL_STEPS" --warmup 2 --cores-ratio "$CORES_RATIO" --json
  adam_threads=$(( $("$PY" -c 'import os; print(len(os.sched_getaffinity(0)))') * 3 / 4 ))
  section "bench/cpu_adam.py: C++ AdamW and accumulation vs torch ($ADAM_PARAMS params, $adam_threads threads)" 60 \
    cpu_adam.json -- "$PY" -m bench.cpu_adam --quick --params "$ADAM_PARAMS" \
    --threads "$(( adam_threads > 0 ? adam_threads : 1 ))" --json
else
  echo "== engine_ops, GIL, cpu_adam: skipped (no C++ optimizer)"
fi
if [ "$DEVICE" = cuda ] && [ "$CPP_OK" = 1 ]; then
  section "bench/memory.py --run: planned vs measured (small-llama, bf16)" 120 memory_run.json -- \
    "$PY" -m bench.memory --models '' --gpus '' --no-packing --run --device "$DEVICE" --run-model small-llama \
    --run-batch 8 --run-seq 1024 --run-steps 8 --json
fi
# zenflow with device accumulation, in the headline's document, if time is left
if [ -n "$EXTRA_MODES" ] && [ -f "$WORK/gpu_check.json" ]; then
  echo "== headline, extra variants ($EXTRA_MODES)"
  engine "$EXTRA_MODES" "$HEADLINE_TIMEOUT" gpu_check_extra.json
  publish
fi

# --- 9. the report ---------------------------------------------------------------------------------
echo "== report (at $(elapsed)s)"
"$PY" -m bench.gpu_report --out "$WORK"
copy_out
echo "== done in $(elapsed)s; files in $OUTDIR, sections in $WORK"
[ -f "$WORK/gpu_check.json" ] || exit 1
