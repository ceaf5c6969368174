#!/usr/bin/env bash
# The GPU check, run from the folder `make gpu-bundle` packs, on a GPU
# machine: the real-GPU tests with FERRY_REQUIRE_GPU=1 (a missing GPU fails),
# then the GPU benchmark, then `ferry demo --device cuda`; prints one summary.
# Builds nothing; stays within 8 minutes (tests 120 s, benchmark 270 s, demo
# 90 s at most).
# Environment: FERRY_BENCH_GPU_BYTES (default 4 GiB), FERRY_BENCH_DIR
# (default ./bench-tmp, on the disk the bundle is on).
set -u
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
export FERRY_REQUIRE_GPU=1
export UCX_MODULE_DIR="$here/lib/ucx"
export FERRY_BENCH_DIR="${FERRY_BENCH_DIR:-$here/bench-tmp}"
log="$here/gpu_check.log"
: >"$log"

echo "== ferry GPU check: $(date -u +%FT%TZ) on $(hostname)" | tee -a "$log"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi -L 2>&1 | tee -a "$log"
else
  echo "nvidia-smi not found" | tee -a "$log"
fi

start=$(date +%s)
timeout 120 bin/ferry_gpu_tests -r compact 2>&1 | tee -a "$log"
tests_rc=${PIPESTATUS[0]}
tests_s=$(($(date +%s) - start))

start=$(date +%s)
timeout 270 bin/ferry_bench_gpu 2>&1 | tee -a "$log"
bench_rc=${PIPESTATUS[0]}
bench_s=$(($(date +%s) - start))
json=$(grep '^{"bench":"ferry_bench_gpu"' "$log" | tail -1)
rm -rf "$FERRY_BENCH_DIR"

# The demo on GPU tensors: trains, checkpoints, restores with another sharding
# and checks every byte.
start=$(date +%s)
demo_root="$here/demo-tmp"
timeout 90 bin/ferry demo --device cuda --ranks 1 --restore-ranks 2 --state-mib 512 \
  --steps 20 --every 5 --root "$demo_root" 2>&1 | tee -a "$log"
demo_rc=${PIPESTATUS[0]}
demo_s=$(($(date +%s) - start))
rm -rf "$demo_root"

verdict() {
  case $1 in
    0) echo PASS ;;
    124) echo "TIMEOUT" ;;
    77) echo "NO GPU (rc 77)" ;;
    *) echo "FAIL (rc $1)" ;;
  esac
}
echo
echo "== summary"
echo "gpu tests:  $(verdict "$tests_rc") in ${tests_s}s"
echo "gpu bench:  $(verdict "$bench_rc") in ${bench_s}s"
echo "gpu demo:   $(verdict "$demo_rc") in ${demo_s}s"
echo "bench json: ${json:-none}"
echo "log:        $log"
[[ $tests_rc -eq 0 && $bench_rc -eq 0 && $demo_rc -eq 0 ]]
