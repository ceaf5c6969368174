#!/usr/bin/env bash
# Ferry's save and load through an s3:// root next to Debian's awscli (`aws
# s3 cp`, its multipart defaults and with 8 concurrent requests) and the
# server's own limit (bench/ferry_bench_s3: 8 MiB objects, 8 requests at a
# time through Ferry's S3 client, nothing checked), moving the same bytes to and from the same server in one run;
# the ratios, and Ferry's peak RSS growth against pool + 64 MiB.
#
#   bench/s3_compare.sh [--mib N] [--reps N] [--build DIR]
#
# The server: FERRY_S3_ENV's (tests/s3/s3server.sh start writes it), else
# one started here and stopped at the end. Exits 77 where none can start.
# Every figure is the median of --reps runs (default 3), each tool's runs
# interleaved with the others'. The last line is one JSON object.
set -euo pipefail

mib=256
reps=3
here="$(cd "$(dirname "$0")/.." && pwd)"
build="$here/build"
while [ $# -gt 0 ]; do
  case "$1" in
    --mib) mib="$2"; shift 2 ;;
    --reps) reps="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    *) echo "usage: $0 [--mib N] [--reps N] [--build DIR]" >&2; exit 2 ;;
  esac
done
# No server or tool: a skip (77), or a failure under FERRY_REQUIRE_S3=1.
skip=77
[ "${FERRY_REQUIRE_S3:-}" = 1 ] && skip=1
aws=/usr/bin/aws  # Debian's awscli, not one a Python environment put first on PATH
for tool in "$aws" curl "$build/bench/ferry_bench_save" "$build/bench/ferry_bench_s3"; do
  command -v "$tool" >/dev/null || { echo "s3_compare: $tool is missing (scripts/install-deps.sh --tests)"; exit "$skip"; }
done

work="$(mktemp -d "${TMPDIR:-/tmp}/ferry-s3cmp-XXXXXX")"
data="/dev/shm/ferry-s3cmp-$$"  # sources and downloads in memory: no disk in the figures
started=""
cleanup() {
  rm -rf "$work" "$data"
  if [ -n "$started" ]; then bash "$here/tests/s3/s3server.sh" stop "$started" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

env_file="${FERRY_S3_ENV:-}"
if [ -z "$env_file" ] || [ ! -f "$env_file" ]; then
  started="$work/server"
  if ! bash "$here/tests/s3/s3server.sh" start "$started" >"$work/server.log" 2>&1; then
    echo "s3_compare: no S3 server: $(tail -n 3 "$work/server.log")"
    exit "$skip"
  fi
  env_file="$started/env"
fi
if grep -q FERRY_S3_UNAVAILABLE "$env_file"; then
  echo "s3_compare: no S3 server: $(grep FERRY_S3_UNAVAILABLE "$env_file")"
  exit "$skip"
fi
set -a
# shellcheck disable=SC1090
. "$env_file"
set +a
endpoint="$FERRY_S3_ENDPOINT"
bucket="ferry-s3cmp-$$"
sig=(--aws-sigv4 "aws:amz:${AWS_REGION}:s3" -u "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY"
     -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" -H "Content-Type: application/octet-stream")
curl -sf -X PUT "${sig[@]}" "$endpoint/$bucket" >/dev/null

mkdir -p "$data"
head -c "$((mib << 20))" /dev/urandom >"$data/src.bin"
bytes=$((mib << 20))

now() { date +%s.%N; }
mib_s() { awk -v b="$bytes" -v t0="$1" -v t1="$2" 'BEGIN { printf "%.1f", b / 1048576 / (t1 - t0) }'; }
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }'; }

# awscli: its defaults (multipart at 8 MiB, 10 requests at once), then 8.
printf '[default]\nregion = %s\n' "$AWS_REGION" >"$work/aws-default"
cp "$work/aws-default" "$work/aws-8"
AWS_CONFIG_FILE="$work/aws-8" "$aws" configure set default.s3.max_concurrent_requests 8
aws_run() {  # config, direction -> MiB/s
  local t0 t1
  t0=$(now)
  if [ "$2" = up ]; then
    AWS_CONFIG_FILE="$1" "$aws" --endpoint-url "$endpoint" s3 cp --only-show-errors \
      "$data/src.bin" "s3://$bucket/aws/obj"
  else
    AWS_CONFIG_FILE="$1" "$aws" --endpoint-url "$endpoint" s3 cp --only-show-errors \
      "s3://$bucket/aws/obj" "$data/dl.bin"
    rm -f "$data/dl.bin"
  fi
  t1=$(now)
  mib_s "$t0" "$t1"
}
# What every aws run pays before it moves a byte (Python starting), for reading small runs.
t0=$(now)
AWS_CONFIG_FILE="$work/aws-default" "$aws" --version >/dev/null
aws_start=$(awk -v t0="$t0" -v t1="$(now)" 'BEGIN { printf "%.2f", t1 - t0 }')
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
declare -a f_up f_down a_up a_down a8_up a8_down l_up l_down
rss=""
for r in $(seq 1 "$reps"); do
  out=$("$build/bench/ferry_bench_save" --root "s3://$bucket/ferry-$r" --state-mib "$mib" \
    --tensors 16 --reps 1 --set "s3-endpoint=$endpoint")
  json=$(printf '%s\n' "$out" | tail -n 1)
  f_up+=("$(printf '%s' "$json" | sed 's/.*"save_mib_s":\([0-9.]*\).*/\1/')")
  f_down+=("$(printf '%s' "$json" | sed 's/.*"load_mib_s":\([0-9.]*\).*/\1/')")
  rss="$(printf '%s' "$json" | sed 's/.*"pool_mib":\([0-9.]*\),"rss_growth_mib":\([0-9.-]*\).*/\2 \1/')"
  a_up+=("$(aws_run "$work/aws-default" up)")
  a_down+=("$(aws_run "$work/aws-default" down)")
  a8_up+=("$(aws_run "$work/aws-8" up)")
  a8_down+=("$(aws_run "$work/aws-8" down)")
  limit=$("$build/bench/ferry_bench_s3" --endpoint "$endpoint" --bucket "$bucket" --mib "$mib" | tail -n 1)
  l_up+=("$(printf '%s' "$limit" | sed 's/.*"put_mib_s":\([0-9.]*\).*/\1/')")
  l_down+=("$(printf '%s' "$limit" | sed 's/.*"get_mib_s":\([0-9.]*\).*/\1/')")
  echo "run $r: save ferry ${f_up[-1]} aws ${a_up[-1]} aws8 ${a8_up[-1]} limit ${l_up[-1]};" \
       "load ferry ${f_down[-1]} aws ${a_down[-1]} aws8 ${a8_down[-1]} limit ${l_down[-1]} MiB/s"
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

fu=$(median "${f_up[@]}"); fd=$(median "${f_down[@]}")
au=$(median "${a_up[@]}"); ad=$(median "${a_down[@]}")
a8u=$(median "${a8_up[@]}"); a8d=$(median "${a8_down[@]}")
lu=$(median "${l_up[@]}"); ld=$(median "${l_down[@]}")
read -r growth pool <<<"$rss"
echo
echo "s3_compare: $mib MiB, $reps runs (medians), $endpoint, $(nproc) CPUs, load $load_before -> $load_after"
printf '  %-5s ferry %7s  aws %7s (x%s)  aws-8 %7s (x%s)  server limit %7s (x%s) MiB/s\n' \
  save "$fu" "$au" "$(ratio "$fu" "$au")" "$a8u" "$(ratio "$fu" "$a8u")" "$lu" "$(ratio "$fu" "$lu")"
printf '  %-5s ferry %7s  aws %7s (x%s)  aws-8 %7s (x%s)  server limit %7s (x%s) MiB/s\n' \
  load "$fd" "$ad" "$(ratio "$fd" "$ad")" "$a8d" "$(ratio "$fd" "$a8d")" "$ld" "$(ratio "$fd" "$ld")"
echo "  goals: >= 1.2x aws s3 cp, >= 0.8x the server's limit (aws --version alone takes $aws_start s)"
echo "  ferry peak rss growth $growth MiB (pool $pool MiB + 64 = $(awk -v p="$pool" 'BEGIN{print p+64}'))"
printf '{"mib":%s,"reps":%s,"save":{"ferry":%s,"aws":%s,"aws8":%s,"limit":%s},' "$mib" "$reps" "$fu" "$au" "$a8u" "$lu"
printf '"load":{"ferry":%s,"aws":%s,"aws8":%s,"limit":%s},"rss_growth_mib":%s,"pool_mib":%s,"aws_start_s":%s,"loadavg":"%s"}\n' \
  "$fd" "$ad" "$a8d" "$ld" "$growth" "$pool" "$aws_start" "$load_after"
