#!/usr/bin/env bash
# The one script a hardware run needs (one H200, a short loan): everything under 8 minutes, each stage
# with its own timeout, failures recorded and the script carrying on.
#   nvidia-smi -> build the CUDA extension -> every GPU test (the CUDA and Triton backends' tests,
#   tests/test_gpu_*.py) -> bench/gpu_check.py: paper-scale correctness of triton and cuda against
#   the torch backend on the same GPU (bitwise integer columns, 1e-6 advantages; groups with
#   thousands of distinct ids raced by many programs; a forced overflow; a non-default stream;
#   out=; another device; the id check) and the paper batch's timings (each stage; bandwidth against
#   a measured device copy) -> the scaling sweep (torch, triton, cuda) -> the torch profile -> the
#   whole test suite with the time left.
# The whole run ends within KTAE_GPU_BUDGET_S seconds (default 450). Everything lands in
# bench/results/ as <device>-<date>-*.{log,json,png}; when $OUT is set (the lending tool's output
# folder) a tarball of them and the main log are copied there too.
#
#   bash bench/gpu.sh                    # from the repository root
#   PYTHON=/path/to/python bash bench/gpu.sh
#   KTAE_GPU_DRY_RUN=1 bash bench/gpu.sh # on a CPU: checks the script (tiny shapes, interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."

START=$(date +%s)
BUDGET=${KTAE_GPU_BUDGET_S:-450}
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

if [[ -n "${KTAE_GPU_DRY_RUN:-}" ]]; then
  say "dry run on $(hostname) at $(date -Is): the Python stages on tiny CPU shapes"
  run_stage gpu-check 120 "$PY" -m bench.gpu_check --dry-run --repeats 2 --out "$RESULTS"
  say "done in $(($(date +%s) - START))s; files in $RESULTS:"
  ls "$RESULTS" | tee -a "$LOG"
  exit 0
fi

say "ktae_kernels GPU run on $(hostname) at $(date -Is), budget ${BUDGET}s, python: $(command -v "$PY")"
run_stage nvidia-smi 20 nvidia-smi
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

# 2. every GPU test: the backends' tests on the GPU (the interpreter is off when CUDA is visible);
#    the CPU emulator of the CUDA kernels (test_cuda_emulation.py) runs with the whole suite in 6.
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")
GPU_TESTS=$(ls tests/test_cuda_*.py tests/test_triton_*.py tests/test_gpu_*.py 2>/dev/null | grep -v test_cuda_emulation | tr '\n' ' ')
run_stage gpu-tests 110 "$PY" -m pytest -q $GPU_TESTS $XDIST -p no:cacheprovider

# 3. paper-scale correctness against the torch backend, then the paper batch's timings by stage
run_stage gpu-check 100 "$PY" -m bench.gpu_check --repeats 20 --out "$RESULTS"

# 4. the scaling sweep (G=16, B=256..65536, L=512..8192) with the paper batch and the copy bandwidth
run_stage sweep 90 "$PY" -m bench --device cuda --sweep --backends torch,triton,cuda --repeats 10 \
  --no-progress --out "$RESULTS"

# 5. where the torch backend's GPU time goes on the paper batch
run_stage profile 30 "$PY" -m bench.profile_torch --device cuda --prompts 1024 --L 3072 --repeats 5 --ops

# 6. the whole test suite with CUDA visible, with the time left
run_stage tests 300 "$PY" -m pytest -q tests $XDIST -p no:cacheprovider

say "done in $(($(date +%s) - START))s; files:"
ls -l "$PREFIX"* | tee -a "$LOG"
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
  tar czf "$OUT/gpu-results.tgz" "$PREFIX"* "$RESULTS"/*gpu-check* 2>/dev/null
  cp "$LOG" "$OUT/" 2>/dev/null
fi
exit 0
