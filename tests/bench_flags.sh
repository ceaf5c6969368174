#!/usr/bin/env bash
# The benches' flags (tools/flags.hpp, CLI11): sizes as the settings write
# them, counts above 0, and a usage error that names the flag (or the
# environment variable) and exits with 2, before any work starts.
#
#   tests/bench_flags.sh BUILD_DIR
set -u
bench=$1/bench
fails=0

# expect RC PATTERN CMD...: CMD exits RC and its output holds PATTERN (fixed text).
expect() {
  local rc=$1 pattern=$2
  shift 2
  local out got
  out=$("$@" 2>&1)
  got=$?
  if [ "$got" -ne "$rc" ] || ! grep -qF -- "$pattern" <<<"$out"; then
    echo "FAIL: $* -> exit $got (want $rc), output lacks '$pattern':"
    sed 's/^/    /' <<<"$out" | head -5
    fails=$((fails + 1))
  else
    echo "ok: $* -> $got, '$pattern'"
  fi
}

load=$bench/ferry_bench_load save=$bench/ferry_bench_save
plan=$bench/ferry_bench_plan s3=$bench/ferry_bench_s3 gpu=$bench/ferry_bench_gpu

expect 0 "--bytes SIZE" "$load" --help
expect 2 "--bytes: '1.5GiB' is not a size" "$load" --bytes 1.5GiB
expect 2 "--bytes: '0': the size must be positive" "$load" --bytes 0
expect 2 "--tensors" "$load" --tensors 1K
expect 2 "--tensors" "$load" --tensors 0
expect 2 "--ranks" "$load" --ranks -2
expect 2 "--pool-mib" "$load" --pool-mib 64MiB
expect 2 "--set" "$load" --set direct-io
expect 2 "--bogus" "$load" --bogus 1
# Past the flags (sizes in any of the settings' units taken) to a check of its own.
expect 2 "--by-cols goes with --reshard" "$load" --bytes 1GB --by-cols
expect 2 "--by-cols goes with --reshard" "$load" --bytes " 64 mib " --by-cols --set a=b --set c=d

expect 0 "--state-mib" "$save" --help
expect 2 "--state-mib" "$save" --state-mib 1GiB
expect 2 "--chunk-mib" "$save" --chunk-mib 0
expect 2 "--compress-level" "$save" --compress-level 23
expect 2 "--set" "$save" --set =1
expect 2 "is too many for 1 MiB" "$save" --state-mib 1 --tensors 100000 --tensors 100000

expect 0 "--ranks" "$plan" --help
expect 2 "--ranks" "$plan" --ranks 64,0
expect 2 "--ranks" "$plan" --ranks 64,2x
expect 2 "--items" "$plan" --items 2x
expect 2 "--shape" "$plan" --shape round

if [ -x "$s3" ]; then
  expect 2 "--part-mib" "$s3" --bucket b --part-mib 0
fi
if [ -x "$gpu" ]; then
  expect 2 "FERRY_BENCH_GPU_BYTES: '4 GiBs' is not a size" env FERRY_BENCH_GPU_BYTES="4 GiBs" "$gpu"
  expect 2 "FERRY_BENCH_CHUNK: '0': the size must be positive" env FERRY_BENCH_CHUNK=0 "$gpu"
fi

[ "$fails" -eq 0 ] || { echo "$fails failed"; exit 1; }
echo "all passed"
