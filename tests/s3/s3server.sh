#!/usr/bin/env bash
# A throw-away S3 server for the tests: a one-node Ceph cluster (one mon, one
# in-memory OSD, no auth between its daemons) with radosgw on 127.0.0.1.
#
#   s3server.sh start DIR   starts it with every file under DIR, writes
#                           DIR/env (FERRY_S3_ENDPOINT, AWS_ACCESS_KEY_ID,
#                           AWS_SECRET_ACCESS_KEY, AWS_REGION) and prints it
#   s3server.sh stop DIR    stops it and removes DIR
#
# Where the server cannot run here, start writes FERRY_S3_UNAVAILABLE=<why>
# into DIR/env and exits 77 (the tests' skip code). Start first stops what
# an earlier run left in DIR.
set -euo pipefail

cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }

# A throw-away cluster: SIGKILL, nothing of it needs to be kept.
stop() {
  [ -d "$dir/run" ] || return 0
  local pids=()
  for f in "$dir"/run/*.pid; do
    [ -f "$f" ] && pids+=("$(cat "$f")")
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -9 "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 50); do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
}

if [ "$cmd" = stop ]; then
  stop
  rm -rf "$dir"
  exit 0
fi
[ "$cmd" = start ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }

stop
rm -rf "$dir"
mkdir -p "$dir"/{mon,osd,run,log,rgw}
for tool in ceph-mon ceph-osd radosgw radosgw-admin monmaptool ceph python3 curl; do
  command -v "$tool" >/dev/null || {
    why="$tool is missing (make test installs ceph-mon, ceph-osd and radosgw)"
    echo "FERRY_S3_UNAVAILABLE=$why" > "$dir/env"
    echo "s3server: $why" >&2
    exit 77
  }
done
dir=$(cd "$dir" && pwd)
# Two ports free now, asked for while both are held so they differ.
read -r mon_port rgw_port < <(python3 -c 'import socket
a, b = socket.socket(), socket.socket()
a.bind(("127.0.0.1", 0)); b.bind(("127.0.0.1", 0))
print(a.getsockname()[1], b.getsockname()[1])')
fsid=$(cat /proc/sys/kernel/random/uuid)

# No cephx: a test cluster on loopback. The client mode line keeps radosgw
# from looping on an auth error; the paxos lines make start-up take 2 s, not 12.
cat > "$dir/ceph.conf" <<CONF
[global]
fsid = $fsid
mon_host = v1:127.0.0.1:$mon_port
mon_initial_members = a
ms_bind_msgr2 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
ms_mon_client_mode = crc secure
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
paxos_propose_interval = 0.05
paxos_min_wait = 0.01
run_dir = $dir/run
log_file = $dir/log/\$name.log
admin_socket = $dir/run/\$name.asok
pid_file = $dir/run/\$name.pid
mon_data = $dir/mon/\$id
osd_data = $dir/osd/\$id
osd_objectstore = memstore
osd_class_update_on_start = false
memstore_device_bytes = 8589934592
[client.rgw]
rgw_frontends = beast endpoint=127.0.0.1:$rgw_port
rgw_data = $dir/rgw
CONF
export CEPH_CONF="$dir/ceph.conf"
fail() {
  echo "s3server: $1 (logs in $dir/log)" >&2
  tail -n 5 "$dir"/log/*.log 1>&2 || true
  exit 1
}
# A client's first command to the mon now and then goes out before it knows
# the cluster's fsid and is refused ("wrong fsid", EPERM) at once; the same
# command again works. Every step that talks to the mon is retried.
retried() {
  local i
  for i in 1 2 3 4 5; do
    "$@" 2>>"$dir/log/setup.log" && return 0
    sleep 0.2
  done
  return 1
}
monmaptool --create --clobber --fsid "$fsid" --addv a "[v1:127.0.0.1:$mon_port]" "$dir/monmap" \
  >/dev/null || fail "monmaptool failed"
ceph-mon --mkfs -i a --monmap "$dir/monmap" 2>>"$dir/log/setup.log" || fail "ceph-mon --mkfs failed"
ceph-mon -i a 2>>"$dir/log/setup.log" || fail "ceph-mon did not start"
osd_uuid=$(cat /proc/sys/kernel/random/uuid)
osd_id=$(retried timeout 30 ceph osd new "$osd_uuid") || fail "ceph osd new failed"
mkdir -p "$dir/osd/$osd_id"
ceph-osd -i "$osd_id" --mkfs --osd-uuid "$osd_uuid" 2>>"$dir/log/setup.log" || fail "ceph-osd --mkfs failed"
retried ceph-osd -i "$osd_id" || fail "ceph-osd did not start"
radosgw -n client.rgw 2>>"$dir/log/setup.log" || fail "radosgw did not start"
up=0
starts=1
for _ in $(seq 300); do
  code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$rgw_port/" || true)
  [ "$code" = 200 ] && { up=1; break; }
  # radosgw can fail its start the same way, after it forked: start it again.
  if ! kill -0 "$(cat "$dir/run/client.rgw.pid" 2>/dev/null || echo 0)" 2>/dev/null &&
    [ $starts -lt 4 ]; then
    sleep 0.5
    if ! kill -0 "$(cat "$dir/run/client.rgw.pid" 2>/dev/null || echo 0)" 2>/dev/null; then
      starts=$((starts + 1))
      radosgw -n client.rgw 2>>"$dir/log/setup.log" || true
    fi
  fi
  sleep 0.1
done
[ $up = 1 ] || fail "radosgw did not answer on 127.0.0.1:$rgw_port within 30 s"
key=FERRYTEST$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n' | tr a-f A-F)
secret=$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')
retried timeout 30 radosgw-admin user create --uid=ferry --display-name=ferry --access-key="$key" \
  --secret="$secret" >/dev/null || fail "radosgw-admin user create failed"
cat > "$dir/env" <<ENV
FERRY_S3_ENDPOINT=http://127.0.0.1:$rgw_port
AWS_ACCESS_KEY_ID=$key
AWS_SECRET_ACCESS_KEY=$secret
AWS_REGION=us-east-1
ENV
cat "$dir/env"
