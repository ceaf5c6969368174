#!/usr/bin/env bash
# Emulated hosts on one machine, for tests and by hand (needs root, iproute2
# and util-linux). Host I of a set NAME is a network namespace with a veth
# into the set's bridge (address 10.77.0.<I+1>/24 on eth0) plus its own UTS
# (host name NAME-I), IPC, PID and mount namespaces: UCX then sees no shared
# memory between hosts (tests/hosts/README.md), and Ferry's node
# identity (boot id + host name) differs per host. Each host sees its private
# node-local directory at $FERRY_NODE_DIR (one path, different contents per
# host) and the set's shared directory at $FERRY_SHARED_DIR.
#
#   hosts.sh check                       exit 0 if hosts can be made here, else 77 and why
#   hosts.sh up NAME N [--shared DIR] [--owner PID]
#                                        N hosts; an earlier set NAME and the leftovers of
#                                        sets whose owner (default: the caller) is gone are
#                                        removed first
#   hosts.sh run NAME I [--] CMD...      CMD on host I, in the foreground
#   hosts.sh job NAME -n K [--hosts I,J,..] [--port P] [--] CMD...
#                                        K ranks on each host (torchrun's environment:
#                                        RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
#                                        MASTER_ADDR = the first host's address,
#                                        MASTER_PORT, and one FERRY_JOB_TOKEN); lines
#                                        prefixed "[rank R] "; exit 0 iff every rank did
#   hosts.sh link NAME I up|down         host I's cable
#   hosts.sh rate NAME I RATE|off        caps host I's link each way (tc tbf, RATE as tc
#                                        takes it: 1gbit, 200mbit)
#   hosts.sh kill NAME I                 SIGKILL every process of host I (the host is gone)
#   hosts.sh addr NAME I                 host I's address
#   hosts.sh bytes NAME I                bytes host I sent and received on its link
#   hosts.sh down NAME                   removes the set (idempotent)
#   hosts.sh clean                       removes every set whose owner is gone
#
# NAME: 1-8 of [a-z0-9] (interface names are at most 15 bytes). State lives
# under /run/ferry-hosts/NAME; resources are named fh<NAME>...
set -uo pipefail

STATE_BASE=${FERRY_HOSTS_STATE:-/run/ferry-hosts}
SUBNET=10.77.0

die() {
  echo "hosts: $*" >&2
  exit 1
}

have_tools() {
  [ "$(id -u)" -eq 0 ] || { echo "hosts: needs root (network namespaces)"; return 77; }
  for t in ip unshare nsenter; do
    command -v "$t" >/dev/null 2>&1 || { echo "hosts: '$t' not found (apt-get install iproute2 util-linux)"; return 77; }
  done
}

check() {
  have_tools || return 77
  local ns="fhcheck$$"
  if ! out=$(ip netns add "$ns" 2>&1); then
    echo "hosts: cannot create a network namespace: $out"
    return 77
  fi
  ip netns del "$ns" 2>/dev/null
  if ! out=$(unshare --uts --ipc --pid --mount --fork --mount-proc true 2>&1); then
    echo "hosts: cannot create namespaces: $out"
    return 77
  fi
  return 0
}

valid_name() {
  [[ "$1" =~ ^[a-z0-9]{1,8}$ ]] || die "bad set name '$1' (1-8 of [a-z0-9])"
}

# "pid starttime" of a process, so a reused pid does not pass for its owner.
proc_id() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  echo "$1 $(echo "$stat" | cut -d' ' -f20)"
}

owner_alive() {
  local f="$1/owner" want
  [ -f "$f" ] || return 1
  want=$(cat "$f")
  [ "$(proc_id "${want%% *}" 2>/dev/null)" = "$want" ]
}

down() {
  local name=$1 dir="$STATE_BASE/$1" p="fh$1"
  if [ -d "$dir" ]; then
    for f in "$dir"/h*/pid "$dir"/h*/upid; do
      [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null
    done
  fi
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${p}h[0-9]*$"); do
    ip netns del "$ns" 2>/dev/null
  done
  for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^${p}[bv][0-9]*$"); do
    ip link del "$l" 2>/dev/null
  done
  if [ -d "$dir" ]; then
    umount -l "$dir/nodemnt" 2>/dev/null
    rm -rf "$dir"
  fi
  return 0
}

clean() {
  local d
  for d in "$STATE_BASE"/*; do
    [ -d "$d" ] || continue
    owner_alive "$d" || down "$(basename "$d")"
  done
  # Namespaces and links of a set whose state directory is gone.
  for p in $( (ip netns list 2>/dev/null | awk '{print $1}'; ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1) |
    sed -n 's/^fh\([a-z0-9]\{1,8\}\)[bhv][0-9]*$/\1/p' | sort -u); do
    [ -d "$STATE_BASE/$p" ] || down "$p"
  done
}

up() {
  local name=$1 n=$2
  shift 2
  local shared="" owner=$PPID
  while [ $# -gt 0 ]; do
    case $1 in
      --shared) shared=$2; shift 2 ;;
      --owner) owner=$2; shift 2 ;;
      *) die "up: unknown flag '$1'" ;;
    esac
  done
  valid_name "$name"
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 9 ] || die "up: host count must be 1..9"
  local why
  why=$(have_tools) || { echo "$why" >&2; exit 77; }
  down "$name"
  clean
  local dir="$STATE_BASE/$name" p="fh$name"
  mkdir -p "$dir/nodemnt"
  proc_id "$owner" >"$dir/owner" || die "up: no process $owner to own the hosts"
  [ -n "$shared" ] || shared="$dir/shared"
  mkdir -p "$shared"
  echo "$(cd "$shared" && pwd)" >"$dir/shared_dir"
  echo "$n" >"$dir/n"
  ip link add "${p}b" type bridge || die "up: cannot add bridge ${p}b"
  ip link set "${p}b" up
  local i
  for ((i = 0; i < n; ++i)); do
    local ns="${p}h$i" h="$dir/h$i"
    mkdir -p "$h/node"
    ip netns add "$ns" || die "up: cannot add namespace $ns"
    ip link add "${p}v$i" type veth peer name eth0 netns "$ns" || die "up: cannot add veth ${p}v$i"
    ip link set "${p}v$i" master "${p}b" up
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    # PID 1 of the host: holds its namespaces; killing it ends the host.
    setsid ip netns exec "$ns" unshare --uts --ipc --pid --mount --fork --mount-proc \
      --propagation private bash -c '
        hostname "$1" && mount --bind "$2/node" "$3" && touch "$2/ready" || exit 1
        exec sleep infinity' holder "$name-$i" "$h" "$dir/nodemnt" </dev/null >"$h/log" 2>&1 9>&- &
    echo $! >"$h/upid"
  done
  for ((i = 0; i < n; ++i)); do
    local h="$dir/h$i" upid pid="" tries
    upid=$(cat "$h/upid")
    for ((tries = 0; tries < 500; ++tries)); do
      [ -f "$h/ready" ] && pid=$(cat "/proc/$upid/task/$upid/children" 2>/dev/null | awk '{print $1}')
      [ -n "$pid" ] && break
      kill -0 "$upid" 2>/dev/null || break
      sleep 0.01
    done
    [ -n "$pid" ] || die "up: host $i did not start: $(cat "$h/log")"
    echo "$pid" >"$h/pid"
  done
  # Hosts answer each other (the bridge forwards once its ports are up).
  for ((i = 1; i < n; ++i)); do
    local tries
    for ((tries = 0; tries < 300; ++tries)); do
      # A refused connection is an answer from host 0.
      out=$(ip netns exec "${p}h$i" timeout 1 bash -c "exec 3<>/dev/tcp/$SUBNET.1/9" 2>&1)
      [[ "$out" == *refused* ]] && break
      [ -z "${FERRY_HOSTS_DEBUG:-}" ] || echo "hosts: host $i: $out" >&2
      sleep 0.01
    done
  done
  echo "hosts: $n hosts up as $name-0..$name-$((n - 1)), shared $(cat "$dir/shared_dir")"
}

host_pid() {
  local f="$STATE_BASE/$1/h$2/pid"
  [ -f "$f" ] || die "no host $2 in set $1"
  local pid
  pid=$(cat "$f")
  kill -0 "$pid" 2>/dev/null || die "host $2 of set $1 is gone"
  echo "$pid"
}

run() {
  local name=$1 i=$2
  shift 2
  [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || die "run: no command"
  local dir="$STATE_BASE/$name" pid
  pid=$(host_pid "$name" "$i") || exit 1
  # nsenter stops itself when its child stops (job control) and so never
  # sees the child die with its host: `kill` continues the ones listed here.
  echo $$ >>"$dir/h$i/runs"
  exec nsenter -t "$pid" --net --uts --ipc --pid --mount --wd="$PWD" -- \
    env FERRY_HOST_INDEX="$i" FERRY_HOST_ADDR="$SUBNET.$((i + 1))" \
    FERRY_SHARED_DIR="$(cat "$dir/shared_dir")" FERRY_NODE_DIR="$dir/nodemnt" \
    MASTER_ADDR="${MASTER_ADDR:-$SUBNET.1}" "$@"
}

job() {
  local name=$1
  shift
  local k=1 hosts="" port=29500
  while [ $# -gt 0 ]; do
    case $1 in
      -n) k=$2; shift 2 ;;
      --hosts) hosts=$2; shift 2 ;;
      --port) port=$2; shift 2 ;;
      --) shift; break ;;
      *) break ;;
    esac
  done
  [ $# -gt 0 ] || die "job: no command"
  local dir="$STATE_BASE/$name"
  [ -f "$dir/n" ] || die "no set $name"
  [ -n "$hosts" ] || hosts=$(seq -s, 0 $(($(cat "$dir/n") - 1)))
  IFS=, read -ra hl <<<"$hosts"
  local world=$((k * ${#hl[@]})) token
  token=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
  local pids=() ranks=() r=0 j l
  for ((j = 0; j < ${#hl[@]}; ++j)); do
    for ((l = 0; l < k; ++l)); do
      (
        MASTER_ADDR="$SUBNET.$((hl[0] + 1))" "$0" run "$name" "${hl[j]}" -- env \
          RANK=$r WORLD_SIZE=$world LOCAL_RANK=$l LOCAL_WORLD_SIZE=$k MASTER_PORT=$port \
          FERRY_JOB_TOKEN="$token" "$@" </dev/null 2>&1 | sed -u "s/^/[rank $r] /"
      ) &
      pids+=($!)
      ranks+=($r)
      r=$((r + 1))
    done
  done
  local rc=0 st
  for ((j = 0; j < ${#pids[@]}; ++j)); do
    wait "${pids[j]}"
    st=$?
    if [ "$st" -ne 0 ]; then
      echo "[hosts] rank ${ranks[j]} exited with status $st"
      [ "$rc" -ne 0 ] || rc=$st
    fi
  done
  return "$rc"
}

# up, down and clean one at a time: a clean must not take a set that
# another up is still making for an abandoned one.
lock() {
  mkdir -p "$STATE_BASE"
  exec 9>"$STATE_BASE/.lock"
  flock 9
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
  up | down | clean) lock ;;
esac
case $cmd in
  check) check ;;
  up) [ $# -ge 2 ] || die "usage: up NAME N [--shared DIR] [--owner PID]"; up "$@" ;;
  run) [ $# -ge 3 ] || die "usage: run NAME I [--] CMD..."; run "$@" ;;
  job) [ $# -ge 2 ] || die "usage: job NAME -n K [--hosts I,J] [--port P] [--] CMD..."; job "$@" ;;
  link)
    [ $# -eq 3 ] && [[ "$3" =~ ^(up|down)$ ]] || die "usage: link NAME I up|down"
    ip link set "fh$1v$2" "$3"
    ;;
  rate)
    [ $# -eq 3 ] || die "usage: rate NAME I RATE|off"
    [ -f "$STATE_BASE/$1/h$2/pid" ] || die "no host $2 in set $1"
    # Into the host on the bridge's side of the veth, out of it on eth0.
    for side in "" "-n fh$1h$2"; do
      dev="fh$1v$2"
      [ -z "$side" ] || dev=eth0
      if [ "$3" = off ]; then
        tc $side qdisc del dev "$dev" root 2>/dev/null
      else
        tc $side qdisc replace dev "$dev" root tbf rate "$3" burst 256kb latency 50ms ||
          die "rate: tc cannot cap $dev at '$3'"
      fi
    done
    ;;
  kill)
    [ $# -eq 2 ] || die "usage: kill NAME I"
    [ -f "$STATE_BASE/$1/h$2/pid" ] || die "no host $2 in set $1"
    # Every process of the host's PID namespace, at once; the host's PID 1
    # then ends (after the parents outside, nsenters, reap their children).
    pid=$(cat "$STATE_BASE/$1/h$2/pid")
    if ns=$(readlink "/proc/$pid/ns/pid" 2>/dev/null); then
      for p in /proc/[0-9]*; do
        [ "$(readlink "$p/ns/pid" 2>/dev/null)" = "$ns" ] && kill -9 "${p#/proc/}" 2>/dev/null
      done
    fi
    # An nsenter stopped with its stopped child goes on now and reaps it.
    runs="$STATE_BASE/$1/h$2/runs"
    if [ -f "$runs" ]; then
      while read -r p; do kill -CONT "$p" 2>/dev/null; done <"$runs"
      rm -f "$runs"
    fi
    upid=$(cat "$STATE_BASE/$1/h$2/upid")
    for ((tries = 0; tries < 500; ++tries)); do
      kill -0 "$upid" 2>/dev/null || break
      sleep 0.01
    done
    ;;
  addr) [ $# -eq 2 ] || die "usage: addr NAME I"; echo "$SUBNET.$(($2 + 1))" ;;
  bytes)
    [ $# -eq 2 ] || die "usage: bytes NAME I"
    s=/sys/class/net/fh$1v$2/statistics
    # The root side of the veth: what it received the host sent.
    echo "sent=$(cat $s/rx_bytes) received=$(cat $s/tx_bytes)"
    ;;
  down) [ $# -eq 1 ] || die "usage: down NAME"; valid_name "$1"; down "$1" ;;
  clean) clean ;;
  *) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
