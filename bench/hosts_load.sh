#!/usr/bin/env bash
# Load bench, hosts mode: a replicated state loaded by every rank of N
# emulated hosts (tests/hosts/hosts.sh; root) with a capped storage read rate
# and a capped link rate, with load-sharing = node and = job, beside N x K
# plain readers that each read the whole state at the same storage rate
# (what ranks that share nothing could at best do). Per mode: the load time
# (the slowest rank's), and per host the bytes read from storage, the bytes
# taken whole from other hosts, the bytes sent to them, and what its link
# carried.
#
#   bench/hosts_load.sh [--hosts N] [--per-host K] [--mib M] [--read-mibps R]
#                       [--link RATE] [--rounds R] [--build DIR]
#
# Storage rate: Ferry's fault filesystem sleeps 1 MiB / R per MiB each read
# moves (FERRY_FAULTS=latency:read:...:per=1048576), on every rank; a plain
# reader sleeps what its bytes cost at that rate after reading them (dd).
# Link rate: hosts.sh shape ... rate (tc tbf), each way.
# Defaults: 2 hosts x 2 ranks, 128 MiB, 25 MiB/s storage per reader (an object
# store connection), 1gbit links, 1 round.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
hosts=2 per_host=2 mib=128 read_mibps=25 link=1gbit rounds=1 build="$here/build"
while [ $# -gt 0 ]; do
  case $1 in
    --hosts) hosts=$2 ;;
    --per-host) per_host=$2 ;;
    --mib) mib=$2 ;;
    --read-mibps) read_mibps=$2 ;;
    --link) link=$2 ;;
    --rounds) rounds=$2 ;;
    --build) build=$2 ;;
    *) sed -n '2,/^set -e/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
  shift 2
done
tool="$here/tests/hosts/hosts.sh"
worker="$build/tests/ferry_rank_worker"
[ -x "$worker" ] || { echo "no $worker (build the ferry_rank_worker target)" >&2; exit 1; }
"$tool" check >/dev/null || { "$tool" check; exit 77; }

name="bl$$"
name=${name:0:8}
dir=$(mktemp -d /tmp/ferry-hosts-bench.XXXXXX)
trap '"$tool" down "$name" >/dev/null 2>&1; rm -rf "$dir"' EXIT
"$tool" up "$name" "$hosts" --shared "$dir" --owner $$ >/dev/null
# Microseconds of sleep per MiB read.
per_mib_us=$((1000000 / read_mibps))
faults="latency:read:${per_mib_us}us:per=1048576"

# The state: the worker's model plus one replicated tensor of M MiB, saved
# by the first host's ranks (not timed, no caps).
"$tool" job "$name" -n "$per_host" --hosts 0 -- "$worker" --mode save --step 1 --seed 7 \
  --root "$dir/ck" --big-mib "$mib" >"$dir/save.log" 2>&1 || { cat "$dir/save.log"; exit 1; }
state_bytes=$(find "$dir/ck" -name '*.safetensors' -printf '%s\n' | awk '{s += $1} END {print s}')

for ((i = 0; i < hosts; ++i)); do "$tool" shape "$name" "$i" rate "$link"; done

link_bytes() { "$tool" bytes "$name" "$1" | awk -F'[= ]' '{print $2 + $4}'; }

# One load of the whole state on every rank: the slowest rank's load time,
# and per host read / fetched / sent (LOADSTATS) and its link's bytes.
load_once() {
  local mode=$1 log="$dir/load-$1.log" i
  local before=()
  for ((i = 0; i < hosts; ++i)); do before+=("$(link_bytes "$i")"); done
  FERRY_FAULTS="$faults" "$tool" job "$name" -n "$per_host" -- "$worker" --mode load \
    --layout full --seed 7 --root "$dir/ck" --big-mib "$mib" --evict 1 --set "load-sharing=$mode" \
    >"$log" 2>&1 || { cat "$log" >&2; echo "load ($mode) failed" >&2; exit 1; }
  local ok
  ok=$(grep -c "every byte equal" "$log" || true)
  [ "$ok" -eq $((hosts * per_host)) ] || { cat "$log" >&2; echo "load ($mode): bytes differ" >&2; exit 1; }
  local secs
  secs=$(grep -o 'load_s=[0-9.]*' "$log" | cut -d= -f2 | sort -g | tail -1)
  printf '%-5s load %6.2f s' "$mode" "$secs"
  for ((i = 0; i < hosts; ++i)); do
    local lo=$((i * per_host)) hi=$(((i + 1) * per_host - 1)) r line read=0 fetched=0 sent=0
    for ((r = lo; r <= hi; ++r)); do
      line=$(grep "^\[rank $r\] LOADSTATS" "$log")
      read=$((read + $(sed 's/.* read=\([0-9]*\).*/\1/' <<<"$line")))
      fetched=$((fetched + $(sed 's/.* fetched=\([0-9]*\).*/\1/' <<<"$line")))
      sent=$((sent + $(sed 's/.* hosts_sent=\([0-9]*\).*/\1/' <<<"$line")))
    done
    local carried=$(($(link_bytes "$i") - before[i]))
    printf ' | host %d: read %4d MiB, from hosts %4d MiB, sent %4d MiB, link %4d MiB' "$i" \
      $((read >> 20)) $((fetched >> 20)) $((sent >> 20)) $((carried >> 20))
  done
  echo
}

# N x K plain readers at once, each reading every data file (dd, O_DIRECT,
# 1 MiB blocks) and sleeping what the capped rate costs its bytes: the time
# until the last ends.
plain_once() {
  local t0 t1 i l files
  files=$(find "$dir/ck" -name '*.safetensors')
  t0=$(date +%s.%N)
  for ((i = 0; i < hosts; ++i)); do
    for ((l = 0; l < per_host; ++l)); do
      "$tool" run "$name" "$i" -- sh -c 'for f in $2; do dd if="$f" of=/dev/null bs=1M \
        iflag=direct 2>/dev/null; done; sleep "$1"' plain \
        "$(awk -v b="$state_bytes" -v r="$read_mibps" 'BEGIN {print b / 1048576 / r}')" "$files" &
    done
  done
  wait
  t1=$(date +%s.%N)
  printf 'plain load %6.2f s | %d readers, each read %d MiB\n' \
    "$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')" $((hosts * per_host)) $((state_bytes >> 20))
}

echo "hosts $hosts x $per_host ranks, state $((state_bytes >> 20)) MiB, storage ${read_mibps} MiB/s per reader, links $link"
for ((round = 0; round < rounds; ++round)); do
  load_once node
  load_once job
  plain_once
done
