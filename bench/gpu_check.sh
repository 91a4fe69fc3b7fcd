#!/usr/bin/env bash
# GPU check of the ZenFlow engine, one run that answers issues 3, 11 and 13 on a lent GPU. In order (the new
# paths first, so a run cut short keeps them), every section bounded by one deadline (DEADLINE seconds
# from the start, default 540, under the lent machine's 10-minute limit per command):
#  0. (first; only with 2 or more visible GPUs, else skipped with the reason) bench/distributed.py
#     (issue 13): min(GPUs, 8) NCCL ranks, one GPU each, against one process on the same global
#     batch, modes zenflow / offload / device, a ~0.16B Llama (DIST_MODEL, bf16): steps/s, stall,
#     host optimizer bytes per rank vs one process, bytes reduced / gathered per step, max relative
#     weight difference vs one process -> distributed.json
#     Targets: host_bytes_per_rank_ratio about 1/N for zenflow and offload, replicas identical.
#  1. bench/engine_ops.py on CUDA, deep preset, bf16, zenflow and zenflow-dacc: a reselection inside the
#     counted steps (new_epoch at half of them), NaN gradients injected before two steps, the first
#     OPS_PROFILE_STEPS steps under torch.profiler: kernels and host syncs per plain / window-end step,
#     before and after the reselection, on the reselection and on the skipped steps; CUDA kernel launches
#     and blocking runtime calls per step (profiler); whether the bad steps changed nothing
#     -> engine_ops_bf16.json (targets: zero host syncs on a plain zenflow step, at most one on a window
#     end and on a reselection, plain-step kernels after a reselection within 10% of before)
#  2. the same with fp16 parameters (the engine's dynamic loss scaling) and select_interval 4 (a
#     reselection at every window end) -> engine_ops_fp16.json
#  3. bench/engine.py on CUDA, small preset, zenflow and zenflow-dacc: the CPU worker's GIL hold per step
#     as a fraction of a GPU step (issue 11 item 5: move the worker out of the GIL if over 1%)
#     -> gil_small.json
#  4. bench/engine.py on CUDA with a ~1.1B-parameter Llama (TinyLlama-1.1B shape, bf16 device params,
#     random init), variants zenflow-dacc / zenflow / device / offload with a reselection in the timed
#     steps: 40 timed steps per variant (+3 untimed), 8 for the slow offload variant (its losses are then
#     not compared); batch 8 x 2048 tokens; zenflow topk_ratio 0.1, update_interval 4, 12 of the 16
#     cores for the CPU optimizer worker (core placement on) -> gpu_check.json
#     Targets (issue 3): zenflow stall fraction <= 5%, >= 3x the steps/s of offload, loss within 1% of device.
#  5. (CUDA, in the time left) bench/memory.py --run: the plan's step time and memory against a short
#     real run per engine mode (small-llama) -> memory_run.json
#
# Usage
#   bash bench/gpu_check.sh                 # on the GPU machine, from anywhere in the repo
#   bash bench/gpu_check.sh --fetch-wheels  # on a machine WITH pip access, before: puts the wheels of the
#                                           # Python packages the GPU image may lack (pydantic and its
#                                           # deps) into .whl/ (git-ignored); carry .whl to the GPU machine
#   DEVICE=cpu MODEL_SIZE=tiny STEPS=2 OFFLOAD_STEPS=2 WARMUP=1 BATCH=2 SEQ=32 bash bench/gpu_check.sh
#                                           # the same pipeline on the CPU, tiny (what tests/bench/test_gpu_check_smoke.py runs)
# Environment: STEPS, OFFLOAD_STEPS, WARMUP, BATCH, SEQ, MODES, CORES_RATIO, TOPK, UPDATE_INTERVAL, DEVICE,
# MODEL_SIZE, BENCH_TIMEOUT, DEADLINE, OPS_MODEL_SIZE, OPS_STEPS, OPS_PROFILE_STEPS, GIL_MODEL_SIZE,
# GIL_STEPS, DIST_MODEL, DIST_STEPS, DIST_TIMEOUT, DIST_NPROC override the defaults below; OUT (if set,
# e.g. by the device runner) receives the JSON files above (gpu_check.json rewritten after every variant,
# so a timeout keeps what finished) and the logs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHL="$ROOT/.whl"
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p "$WHL"
  if [ -d .git ] && ! grep -qx '/.whl/' .git/info/exclude 2>/dev/null; then echo '/.whl/' >> .git/info/exclude; fi
  py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
  "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHL" "${WHEELS[@]}"
  ls -l "$WHL"
  exit 0
fi

STEPS=${STEPS:-40}
OFFLOAD_STEPS=${OFFLOAD_STEPS:-8}
WARMUP=${WARMUP:-3}
BATCH=${BATCH:-8}
SEQ=${SEQ:-2048}
# The zenflow variants first: if the run is cut short, what the targets need most is already in the JSON.
MODES=${MODES:-zenflow-dacc,zenflow,device,offload}
CORES_RATIO=${CORES_RATIO:-0.75}
TOPK=${TOPK:-0.1}
UPDATE_INTERVAL=${UPDATE_INTERVAL:-4}
DEVICE=${DEVICE:-cuda}
MODEL_SIZE=${MODEL_SIZE:-1b}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-330}
DEADLINE=${DEADLINE:-540}
OPS_MODEL_SIZE=${OPS_MODEL_SIZE:-deep}
OPS_STEPS=${OPS_STEPS:-24}
OPS_PROFILE_STEPS=${OPS_PROFILE_STEPS:-16}
GIL_MODEL_SIZE=${GIL_MODEL_SIZE:-small}
GIL_STEPS=${GIL_STEPS:-30}
DIST_MODEL=${DIST_MODEL:-medium}
DIST_STEPS=${DIST_STEPS:-20}
DIST_TIMEOUT=${DIST_TIMEOUT:-180}
DIST_NPROC=${DIST_NPROC:-}
T_START=$(date +%s)
OUTDIR=${OUT:-$ROOT/runs/gpu_check}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1

# 1. A Python with a CUDA torch (any torch for DEVICE=cpu): the repo's venv, else the machine's python3,
#    else a fresh venv (needs pip access).
want_cuda=1; [ "$DEVICE" = cpu ] && want_cuda=0
PY=""
for cand in "$ROOT/.venv/bin/python" python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import sys, torch; sys.exit(0 if $want_cuda == 0 or torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    PY=$(command -v "$cand"); break
  fi
done
if [ -z "$PY" ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "no NVIDIA GPU here (nvidia-smi not found): this check needs a CUDA machine" >&2
    exit 2
  fi
  echo "no Python with a CUDA-enabled torch found; bootstrapping /tmp/zf-venv (needs package-index access)"
  python3 -m venv /tmp/zf-venv
  /tmp/zf-venv/bin/pip install -q torch transformers pydantic ninja numpy
  PY=/tmp/zf-venv/bin/python
fi

# 2. Packages the engine needs that the image may lack (pydantic): carried wheels first, then pip.
if ! "$PY" -c 'import pydantic, transformers' >/dev/null 2>&1; then
  if ls "$WHL"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/zf-site "$WHL"/*.whl
    export PYTHONPATH=/tmp/zf-site${PYTHONPATH:+:$PYTHONPATH}
  else
    "$PY" -m pip install -q pydantic transformers || {
      echo "missing pydantic/transformers and no wheels in .whl/: run 'bash bench/gpu_check.sh --fetch-wheels' where pip works, carry .whl" >&2
      exit 2
    }
  fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

# 3. Environment report.
echo "== environment"
"$PY" - <<'EOF'
import os, platform, torch, transformers, pydantic
print(f"python {platform.python_version()}  torch {torch.__version__}  CUDA {torch.version.cuda}  "
      f"transformers {transformers.__version__}  pydantic {pydantic.VERSION}")
gpu = (f"{torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
       if torch.cuda.is_available() else "none")
print(f"GPU: {gpu}  CPU cores: {len(os.sched_getaffinity(0))}")
EOF
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
free -g | head -2 || true

# 4. Build (or load) the C++ CPU optimizer once, outside the timed runs.
echo "== C++ CPU Adam build"
start=$(date +%s)
"$PY" -c 'from offload.cpu_adam import load_extension, simd_width; load_extension(); print("cpu_adam ready:", simd_width())'
echo "build/load took $(( $(date +%s) - start ))s"

# 5. The checks. libgomp affinity variables from the image would override the engine's core placement:
#    drop them. Each section gets min(its timeout, what is left before the deadline).
unset OMP_PROC_BIND GOMP_CPU_AFFINITY OMP_PLACES
left() { local l=$(( DEADLINE - ($(date +%s) - T_START) )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
section() {  # section NAME TIMEOUT JSON_FILE -- command...
  local name=$1 limit; limit=$(left "$2"); local json=$3; shift 4
  if [ "$limit" -le 5 ]; then echo "== $name: skipped (deadline)"; return 0; fi
  echo "== $name (up to ${limit}s)"
  local rc=0
  timeout "$limit" "$@" > "$OUTDIR/$json.tmp" 2> >(tee "$OUTDIR/${json%.json}.log" >&2) || rc=$?
  if [ "$rc" = 0 ]; then mv "$OUTDIR/$json.tmp" "$OUTDIR/$json"; cat "$OUTDIR/$json"; else
    echo "$name exited with $rc (124: cut at ${limit}s)"; rm -f "$OUTDIR/$json.tmp"; fi
}
rm -f "$OUTDIR"/engine_ops_bf16.json "$OUTDIR"/engine_ops_fp16.json "$OUTDIR"/gil_small.json "$OUTDIR/gpu_check.json" \
  "$OUTDIR"/distributed.json
# The multi-GPU section (0. above) first: only where 2 or more GPUs are visible to this process.
n_gpus=0
[ "$DEVICE" = cuda ] && n_gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$n_gpus" -ge 2 ]; then
  nproc=${DIST_NPROC:-$(( n_gpus < 8 ? n_gpus : 8 ))}
  section "bench/distributed.py: $nproc NCCL ranks vs one process ($DIST_MODEL, $DEVICE)" \
    "$DIST_TIMEOUT" distributed.json -- "$PY" -m bench.distributed --nproc "$nproc" --device cuda \
    --model "$DIST_MODEL" --steps "$DIST_STEPS" --warmup 3 --timeout "$(( DIST_TIMEOUT / 2 ))" --json
else
  reason="$n_gpus GPU(s) visible"; [ "$DEVICE" = cuda ] || reason="DEVICE=$DEVICE"
  echo "== bench/distributed.py (multi-GPU): skipped ($reason; needs 2 or more GPUs)"
fi
section "bench/engine_ops.py: reselection, bad gradients, host syncs, launches ($OPS_MODEL_SIZE, bf16, $DEVICE)" \
  120 engine_ops_bf16.json -- "$PY" -m bench.engine_ops --device "$DEVICE" --model-size "$OPS_MODEL_SIZE" \
  --modes zenflow,zenflow-dacc --dtype bf16 --steps "$OPS_STEPS" --bad-steps 5,13 \
  --profile-steps "$OPS_PROFILE_STEPS" --cores-ratio "$CORES_RATIO" --json
section "bench/engine_ops.py: fp16 loss scaling, a reselection every window ($OPS_MODEL_SIZE, $DEVICE)" \
  90 engine_ops_fp16.json -- "$PY" -m bench.engine_ops --device "$DEVICE" --model-size "$OPS_MODEL_SIZE" \
  --modes zenflow --dtype fp16 --select-interval 4 --steps 16 --bad-steps 6 --profile-steps 8 \
  --cores-ratio "$CORES_RATIO" --json
section "bench/engine.py: worker GIL hold per step ($GIL_MODEL_SIZE, $DEVICE)" \
  100 gil_small.json -- "$PY" -m bench.engine --device "$DEVICE" --model-size "$GIL_MODEL_SIZE" \
  --modes zenflow,zenflow-dacc --steps "$GIL_STEPS" --warmup 2 --cores-ratio "$CORES_RATIO" --json

# 6. The end-to-end benchmark: table on stdout, JSON to a file (printed after).
limit=$(left "$BENCH_TIMEOUT")
echo "== bench/engine.py ($MODEL_SIZE preset, $DEVICE, up to ${limit}s)"
rc=0
if [ "$limit" -le 5 ]; then echo "skipped (deadline)"; rc=124; else
timeout "$limit" "$PY" -m bench.engine --device "$DEVICE" --model-size "$MODEL_SIZE" --modes "$MODES" \
  --steps "$STEPS" --offload-steps "$OFFLOAD_STEPS" --warmup "$WARMUP" --batch "$BATCH" --seq "$SEQ" \
  --cores-ratio "$CORES_RATIO" --topk-ratio "$TOPK" --update-interval "$UPDATE_INTERVAL" \
  --json-out "$OUTDIR/gpu_check.json" 2>&1 | tee "$OUTDIR/gpu_check.log" || rc=$?
fi
[ "$rc" = 0 ] || echo "bench/engine.py exited with $rc (124: cut at ${limit}s; the JSON holds the variants that finished)"

# 7. The plan against a short real run (issue 12), CUDA only, in the time left: per engine mode, the
#    plan's step time, device bytes and engine host bytes against the measured ones -> memory_run.json
if [ "$DEVICE" = cuda ]; then
  section "bench/memory.py --run: planned vs measured (small-llama, bf16, $DEVICE)" 150 memory_run.json -- \
    "$PY" -m bench.memory --models '' --gpus '' --no-packing --run --device "$DEVICE" --run-model small-llama \
    --run-batch 8 --run-seq 1024 --run-steps 8 --json
fi
echo "== JSON"
cat "$OUTDIR/gpu_check.json" 2>/dev/null || echo "(no JSON written)"
echo "== done in $(( $(date +%s) - T_START ))s"
exit "$rc"
