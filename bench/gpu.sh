#!/usr/bin/env bash
# The hardware run for a short GPU loan (15 minutes of device time, the machine's start included): at
# most KTAE_GPU_BUDGET_S seconds of script (default 400), each stage capped, a failed or cut stage
# recorded and the script carrying on. In order:
#   versions  python, torch, triton, cuda-core, NVRTC, setuptools, nanobind, the driver; fails, naming what
#             is missing, when an import a later stage needs fails (tqdm: the [bench] extra; pytest: [test];
#             cuda.core: [cuda])
#   build     the CPU kernel in place (setup.py build_ext --inplace), else by pip install -e .
#             --no-build-isolation; then the CUDA kernels' first-use NVRTC compile, timed
#   check     bench/gpu_check.py: the paper batch's correctness and timings of cuda and triton against
#             torch first, then the other checks (streams, graphs, overflow, races, big groups, tuning)
#   variants  bench/gpu_variants.py: every cuda launch variant on the paper batch (exactness, calls and graph
#             replays between CUDA events, per-kernel times, a host profile), ranked; its JSON handed back
#   tests     the tests that need a GPU (KTAE_GPU_TESTS: other test files, e.g. for a rerun):
#             pytest -v -ra -n 0 --durations=20 (one process: one GPU), each test at most 60 s
#   bench     what time is left: the paper batch through python -m bench (torch, triton, cuda)
# Nothing that runs without a GPU runs here (the interpreter and emulator tests, the compile report).
# After every stage, what the run has so far is copied to $OUT when it is set (the lending tool's
# output folder): gpu.log (this script's log), gpu-check.json, gpu-variants.json, results.tgz (every file of the run).
# A TERM or INT (the lending tool's limit, a Ctrl-C) is passed on to the stage in flight, which ends
# with the script, and what the run has, that stage's partial results included (gpu_check writes its
# JSON after every check), is handed back before the script exits. Each stage runs under `timeout` in
# its own process group (so that a stage's timeout ends all of it); the trap passes the signal to it.
# The run's files land in $KTAE_RESULTS (default bench-results/<device>-<date>-gpu, git-ignored).
#
#   bash bench/gpu.sh                      # from the repository root, on the GPU machine
#   KTAE_GPU_DRY_RUN=1 OUT=/tmp/o bash bench/gpu.sh   # on a CPU: every stage on tiny shapes (a few minutes)
set -uo pipefail
cd "$(dirname "$0")/.."

START=$(date +%s)
BUDGET=${KTAE_GPU_BUDGET_S:-400}
DEADLINE=$((START + BUDGET))
PY=${PYTHON:-python3}
DRY=${KTAE_GPU_DRY_RUN:-}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[[ -n "$DRY" ]] && export TRITON_INTERPRET=1
SLUG=$("$PY" -c "import torch; from bench.machine import machine_slug; print(machine_slug(torch.device('cuda' if torch.cuda.is_available() else 'cpu')))" 2>/dev/null || echo gpu)
RESULTS=${KTAE_RESULTS:-bench-results/$SLUG-$(date +%F)-gpu${DRY:+-dry-run}}
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu.log"
: >"$LOG"

say() { echo "$*" | tee -a "$LOG"; }

# hand_back: what the run has so far, to $OUT (a cut run keeps every finished stage's files)
hand_back() {
  [[ -n "${OUT:-}" ]] || return 0
  mkdir -p "$OUT"
  tar czf "$OUT/results.tgz.part" -C "$RESULTS" . 2>/dev/null && mv "$OUT/results.tgz.part" "$OUT/results.tgz"
  cp "$LOG" "$OUT/gpu.log" 2>/dev/null
  cp "$RESULTS"/*gpu-check*.json "$OUT/gpu-check.json" 2>/dev/null
  cp "$RESULTS"/*gpu-variants*.json "$OUT/gpu-variants.json" 2>/dev/null
  return 0
}

STAGE_PID=
STAGE_NAME=

# cut SIGNAL: the run is cut (TERM, INT): end the stage in flight (its whole process group, TERM first,
# KILL after 5 s), hand back what the run has, exit 128 + the signal's number
cut() {
  local signal=$1
  trap - TERM INT
  say "=== cut by SIG$signal at $(($(date +%s) - START))s${STAGE_NAME:+, in stage [$STAGE_NAME]}"
  if [[ -n "$STAGE_PID" ]]; then
    kill -TERM -- "-$STAGE_PID" 2>/dev/null || kill -TERM "$STAGE_PID" 2>/dev/null
    for _ in $(seq 50); do
      kill -0 "$STAGE_PID" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL -- "-$STAGE_PID" 2>/dev/null
    tail -n 25 "$RESULTS/$STAGE_NAME.log" 2>/dev/null | tee -a "$LOG"
  fi
  hand_back
  exit $((128 + $(kill -l "$signal")))
}
trap 'cut TERM' TERM
trap 'cut INT' INT

# stage NAME CAP_SECONDS CMD...: CMD with timeout min(CAP, time left), its output in $RESULTS/NAME.log
# (in the background, so that the trap runs at once when the run is cut)
stage() {
  local name=$1 cap=$2
  shift 2
  local left=$((DEADLINE - $(date +%s) - 5))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    say "=== [$name] skipped: ${left}s left"
    return 0
  fi
  say "=== [$name] at $(($(date +%s) - START))s, timeout ${limit}s: $*"
  local t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" >"$RESULTS/$name.log" 2>&1 &
  STAGE_PID=$! STAGE_NAME=$name
  wait "$STAGE_PID"
  local rc=$?
  STAGE_PID= STAGE_NAME=
  local status="rc=$rc"
  ((rc == 124 || rc == 137)) && status="TIMED OUT"
  say "=== [$name] $status after $(($(date +%s) - t0))s"
  tail -n 25 "$RESULTS/$name.log" | tee -a "$LOG"
  hand_back
  return 0
}

versions() {
  "$PY" - <<'PY'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "triton", "cuda.core", "cuda.bindings", "setuptools", "nanobind", "numpy"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as err:
        print(name, "missing:", err)
import torch
print("torch cuda", torch.version.cuda, "| device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
PY
  "$PY" - <<'PY'
import importlib, sys
# what the later stages import, and where it comes from
need = {"numpy": "a dependency", "scipy": "a dependency", "torch": "a dependency",
        "tqdm": "the [bench] extra: pip install tqdm", "pytest": "the [test] extra: pip install pytest",
        "xdist": "the [test] extra: pip install pytest-xdist",
        "cuda.core": 'the [cuda] extra: pip install -e ".[cuda]"',
        "ktae_kernels.backends.cuda.runtime": "the cuda backend",
        "bench.gpu_check": "the check stage", "bench.runner": "the bench stage"}
missing = []
for name, where in need.items():
    try:
        importlib.import_module(name)
    except Exception as err:
        missing.append(f"{name} ({where}): {type(err).__name__}: {err}")
if missing:
    print("MISSING for the later stages:", *missing, sep="\n  ")
    sys.exit(1)
print("the later stages' imports: ok")
PY
  local imports=$?
  "$PY" -c "from ktae_kernels.backends.cuda import runtime; print('NVRTC', runtime.nvrtc_version(), '| cache', runtime.cache_dir())" 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  return $imports
}

build() {
  "$PY" setup.py build_ext --inplace ||
    "$PY" -m pip install -e . --no-build-isolation --no-deps --no-index
  "$PY" -c "import time, ktae_kernels as k; t = time.perf_counter(); b = k.available_backends('cuda'); \
print('backends on cuda:', b, f'(the cuda kernels compiled or loaded in {time.perf_counter() - t:.1f} s)')"
}

GPU_TESTS=${KTAE_GPU_TESTS:-"tests/test_gpu_backends.py tests/test_cuda_backend.py tests/test_plan.py
  tests/test_triton_backend.py tests/test_triton_pipeline.py tests/test_device_statistics.py"}
export -f versions build
export PY

say "ktae_kernels GPU run on $(hostname) at $(date -Is), budget ${BUDGET}s${DRY:+, DRY RUN (CPU, tiny shapes)}"
stage versions 40 bash -c versions
if [[ -n "$DRY" ]]; then
  stage build 30 "$PY" -c "import ktae_kernels as k; print('backends on cpu:', k.available_backends('cpu'))"
  stage check 120 "$PY" -m bench.gpu_check --dry-run --repeats 2 --out "$RESULTS"
  stage tests 60 "$PY" -m pytest --collect-only -q -n 0 -p no:cacheprovider $GPU_TESTS
  stage bench 20 "$PY" -m bench --device cpu --shape 4x2x64 --backends torch,triton --repeats 1 --no-progress \
    --no-plot --out "$RESULTS"
else
  stage build 150 bash -c build
  stage check 100 "$PY" -m bench.gpu_check --repeats 20 --out "$RESULTS"
  stage variants 90 "$PY" -m bench.gpu_variants --repeats 20 --out "$RESULTS"
  TIMEOUT=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=60")
  stage tests 100 "$PY" -m pytest -v -ra -n 0 --durations=20 -p no:cacheprovider $TIMEOUT $GPU_TESTS
  stage bench 60 "$PY" -m bench --device cuda --shape 16x1024x3072 --backends torch,triton,cuda --repeats 5 \
    --no-progress --no-plot --out "$RESULTS"
fi
say "done in $(($(date +%s) - START))s; files in $RESULTS: $(ls "$RESULTS" | tr '\n' ' ')"
hand_back
exit 0
