#!/usr/bin/env bash
# Packs the GPU bundle (see mk/gpu.mk). Usage: gpu_bundle.sh BUILD OUT MAX_MIB
set -euo pipefail
build=$1 out=$2 max_mib=$3
src=$(cd "$(dirname "$0")/.." && pwd)
ucx_modules=/usr/lib/x86_64-linux-gnu/ucx

for b in "$build/ferry" "$build/tests/gpu/ferry_gpu_tests" "$build/bench/ferry_bench_gpu"; do
  [[ -x $b ]] || { echo "gpu-bundle: $b is missing (built without CUDA?)" >&2; exit 1; }
done
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib/ucx"
cp "$build/ferry" "$build/tests/gpu/ferry_gpu_tests" "$build/bench/ferry_bench_gpu" "$out/bin/"
cp "$src/bench/gpu_check.sh" "$out/"

# The C/C++ runtime is the target's own (its glibc and libstdc++ are newer);
# everything else travels.
is_system() {
  case "$(basename "$1")" in
    libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | ld-linux*.so.* | \
      libstdc++.so.* | libgcc_s.so.* | libutil.so.* | libresolv.so.*) return 0 ;;
  esac
  return 1
}
copy_deps() {
  local f lib
  for f in "$@"; do
    while read -r lib; do
      is_system "$lib" && continue
      [[ -e "$out/lib/$(basename "$lib")" ]] || cp -L "$lib" "$out/lib/"
    done < <(ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }')
  done
}
copy_deps "$out"/bin/*
# UCX loads its transports at run time from lib/ucx beside libucs (and from
# UCX_MODULE_DIR, which gpu_check.sh sets).
for m in "$ucx_modules"/*.so.0; do cp -L "$m" "$out/lib/ucx/"; done
copy_deps "$out"/lib/ucx/*.so.0 "$out"/lib/*.so*

chmod u+w "$out"/bin/* "$out"/lib/*.so* "$out"/lib/ucx/*
strip --strip-debug "$out"/bin/* "$out"/lib/*.so* "$out"/lib/ucx/*.so*

bytes=$(du -sb "$out" | cut -f1)
mib=$(((bytes + (1 << 20) - 1) >> 20))
echo "gpu-bundle: $out, $mib MiB ($(ls "$out/lib" | wc -l) entries in lib/)"
if ((mib > max_mib)); then
  echo "gpu-bundle: $mib MiB exceeds the $max_mib MiB limit" >&2
  exit 1
fi
