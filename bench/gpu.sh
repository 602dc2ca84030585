#!/usr/bin/env bash
# The one script a hardware run needs (one H200, a short loan): under 8 minutes of device time, each
# stage with its own cap (the caps add up to the budget), failures recorded and the script carrying on.
#   nvidia-smi -> build the CUDA extension -> the GPU tests (those that need a GPU: the CUDA and
#   Triton backends on CUDA, the device statistics kernels, tests/test_gpu_*.py; -ra names every
#   failure and skip) -> bench/gpu_check.py: paper-scale correctness of triton and cuda against the
#   torch backend on the same GPU (bitwise integer columns, 1e-6 advantages; groups with thousands
#   of distinct ids raced by many programs; a forced overflow; a non-default stream; out=; another
#   device; the id check; every tuning variant it times; a repeat-and-compare pass for races; groups
#   of 128 and 1024 rollouts) and the paper batch's timings (each stage; bandwidth against a measured
#   device copy), written after each check and backend so a stage cut by its cap keeps them -> the
#   scaling sweep (torch, triton, cuda) -> the torch profile -> the native CPU kernel on the machine's
#   16 cores (the shapes preset at 16 threads, the paper batch at 1, 2 and 16: a driver process's
#   thread counts, which the 2-core CI machine cannot measure).
# Nothing that needs no GPU runs here: the compile tests, the Triton interpreter, the CUDA emulator,
# the host planning times (bench/host_plan.py) and the rest of the suite run on a CPU machine.
# The whole run ends within KTAE_GPU_BUDGET_S seconds (default 465). Everything lands in
# bench/results/ as <device>-<date>-*.{log,json,png}; when $OUT is set (the lending tool's output
# folder) a tarball of them and the main log are copied there too.
#
#   bash bench/gpu.sh                    # from the repository root
#   PYTHON=/path/to/python bash bench/gpu.sh
#   KTAE_GPU_DRY_RUN=1 bash bench/gpu.sh # on a CPU: every stage that can run there, on tiny shapes
set -uo pipefail
cd "$(dirname "$0")/.."

START=$(date +%s)
BUDGET=${KTAE_GPU_BUDGET_S:-465}
DEADLINE=$((START + BUDGET))
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
RESULTS=bench/results
[[ -n "${KTAE_GPU_DRY_RUN:-}" ]] && RESULTS=$(mktemp -d)  # a dry run leaves the results folder alone
mkdir -p "$RESULTS"

SLUG=$("$PY" -c "import torch; from bench.machine import machine_slug; print(machine_slug(torch.device('cuda')))" 2>/dev/null || echo gpu)
PREFIX="$RESULTS/$SLUG-$(date +%F)"
LOG="$PREFIX-gpu.log"
: >"$LOG"

say() { echo "$*" | tee -a "$LOG"; }

# run_stage NAME CAP_SECONDS CMD...: run CMD with timeout min(CAP, time left), output to $PREFIX-NAME.log
run_stage() {
  local name=$1 cap=$2
  shift 2
  local left=$((DEADLINE - $(date +%s) - 5))
  local limit=$((cap < left ? cap : left))
  if ((limit < 15)); then
    say "=== [$name] skipped: only ${left}s left"
    return 0
  fi
  say "=== [$name] timeout ${limit}s: $*"
  local t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" >"$PREFIX-$name.log" 2>&1
  local rc=$?
  local status="rc=$rc"
  ((rc == 124 || rc == 137)) && status="TIMED OUT"
  say "=== [$name] $status after $(($(date +%s) - t0))s"
  tail -n 30 "$PREFIX-$name.log" | tee -a "$LOG"
  return 0
}

# the tests that need a GPU (the others run on the CPU machine): pytest -ra names every failure
GPU_TESTS="tests/test_cuda_backend.py tests/test_triton_backend.py tests/test_device_statistics.py tests/test_gpu_backends.py
  tests/test_plan.py::test_a_plan_call_is_captured_in_a_cuda_graph_and_replayed"
GPU_TESTS_ARGS="-q -ra -p no:cacheprovider --deselect tests/test_gpu_backends.py::test_gpu_sh_parses
  --deselect tests/test_gpu_backends.py::test_gpu_check_dry_run"

# the native CPU kernel at a driver's thread counts, on this machine's cores (results: cpu-<n>core-*.json)
cpu_threads() {
  local common="--device cpu --backends cpu,cpu+out --repeats 5 --no-progress --no-plot --out $RESULTS"
  local counts=${CPU_THREADS:-1 2 16}
  local most=${counts##* }
  "$PY" -m bench $common ${CPU_SHAPES:---preset shapes} --threads "$most" --tag "threads-$most" || true
  for threads in $counts; do
    "$PY" -m bench $common ${CPU_PAPER:---shape 16x1024x3072} --threads "$threads" --tag paper-threads-$threads || true
  done
}
export -f cpu_threads
export PY RESULTS

if [[ -n "${KTAE_GPU_DRY_RUN:-}" ]]; then
  say "dry run on $(hostname) at $(date -Is): every stage that runs on a CPU, on tiny shapes"
  run_stage gpu-tests 60 "$PY" -m pytest --collect-only $GPU_TESTS $GPU_TESTS_ARGS
  run_stage gpu-check 150 "$PY" -m bench.gpu_check --dry-run --repeats 2 --out "$RESULTS"
  run_stage sweep 60 env TRITON_INTERPRET=1 "$PY" -m bench --device cpu --shape 4x2x64 --backends torch,triton \
    --repeats 1 --no-progress --no-plot --out "$RESULTS"
  run_stage profile 30 "$PY" -m bench.profile_torch --device cpu --prompts 2 --L 64 --repeats 1 --ops
  run_stage host-plan 60 env TRITON_INTERPRET=1 "$PY" -m bench.host_plan --repeats 5 --json "$PREFIX-host-plan.json"
  CPU_SHAPES="--shape 16x2x64" CPU_PAPER="--shape 16x2x64" CPU_THREADS="1 2" run_stage cpu-threads 60 bash -c cpu_threads
  say "done in $(($(date +%s) - START))s; files in $RESULTS:"
  ls "$RESULTS" | tee -a "$LOG"
  grep -h "=== \[" "$LOG" | grep -v "rc=0" | grep -v "timeout" && { say "DRY RUN FAILED"; exit 1; }
  exit 0
fi

say "ktae_kernels GPU run on $(hostname) at $(date -Is), budget ${BUDGET}s, python: $(command -v "$PY")"
run_stage nvidia-smi 10 nvidia-smi
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"

# 1. the CUDA extension (as documented in setup.py); fall back to an in-place build
build() {
  export KTAE_FORCE_CUDA_BUILD=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
  "$PY" -m pip install -e . --no-build-isolation --no-deps --no-index
  # the source tree comes first on PYTHONPATH: make sure the extension sits in it
  "$PY" -c "import ktae_kernels._C" 2>/dev/null || "$PY" setup.py build_ext --inplace
  "$PY" -c "import ktae_kernels._C, ktae_kernels as k; print('backends on cuda:', k.available_backends('cuda'))"
}
export -f build
export PY
run_stage build 150 bash -c build

# 2. the GPU tests (the interpreter is off when CUDA is visible)
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")
run_stage gpu-tests 90 "$PY" -m pytest $GPU_TESTS $GPU_TESTS_ARGS $XDIST

# 3. paper-scale correctness against the torch backend, then the paper batch's timings by stage
run_stage gpu-check 100 "$PY" -m bench.gpu_check --repeats 20 --out "$RESULTS"

# 4. the scaling sweep (G=16, B=256..65536, L=512..8192) with the paper batch and the copy bandwidth
run_stage sweep 50 "$PY" -m bench --device cuda --sweep --backends torch,triton,cuda --repeats 5 \
  --no-progress --out "$RESULTS"

# 5. where the torch backend's GPU time goes on the paper batch
run_stage profile 20 "$PY" -m bench.profile_torch --device cuda --prompts 1024 --L 3072 --repeats 5 --ops

# 6. the native CPU kernel on this machine's cores: the shapes at 16 threads, the paper batch at 1, 2 and 16
run_stage cpu-threads 45 bash -c cpu_threads

say "done in $(($(date +%s) - START))s; files:"
ls -l "$PREFIX"* "$RESULTS"/cpu-*-"$(date +%F)"-*threads* | tee -a "$LOG"
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
  tar czf "$OUT/gpu-results.tgz" "$PREFIX"* "$RESULTS"/*gpu-check* "$RESULTS"/cpu-*-"$(date +%F)"-*threads* 2>/dev/null
  cp "$LOG" "$OUT/" 2>/dev/null
fi
exit 0
