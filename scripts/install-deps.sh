#!/usr/bin/env bash
# Installs the Debian packages Ferry builds against; with --tests also what
# only the test suite runs (the S3 server). Idempotent: does nothing when
# every package is already present. Needs root (or sudo) when it installs.
set -euo pipefail

packages=(
  build-essential cmake pkg-config ccache clang-format
  libcaf-dev libucx-dev ucx-utils
  capnproto libcapnp-dev
  catch2 libcli11-dev libxxhash-dev libzstd-dev rapidjson-dev python3 python3-torch
  libcurl4-openssl-dev libexpat1-dev libssl-dev  # the S3 store (src/s3/)
  iproute2 util-linux nftables  # the many-host tests' emulated hosts (tests/hosts/hosts.sh)
)
# A throw-away Ceph cluster with radosgw: the S3 tests' server (tests/s3/);
# awscli for the S3 bench's reference figures (bench/s3_compare.sh).
if [ "${1:-}" = "--tests" ]; then
  packages+=(ceph-mon ceph-osd radosgw curl awscli)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
