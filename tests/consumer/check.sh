#!/usr/bin/env bash
# Builds tests/consumer against Ferry one of two ways and runs it:
#   check.sh install SOURCE_DIR BUILD_DIR   cmake --install BUILD_DIR, then find_package(Ferry)
#   check.sh subdir  SOURCE_DIR BUILD_DIR   add_subdirectory(SOURCE_DIR)
set -euo pipefail
mode=$1 src=$2 build=$3
work=$(mktemp -d "${TMPDIR:-/tmp}/ferry-consumer-XXXXXX")
trap 'rm -rf "$work"' EXIT
gen=(-DCMAKE_BUILD_TYPE=RelWithDebInfo)
case "$mode" in
  install)
    cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
    # Exactly the public headers are installed, main.cpp includes every one,
    # and the library has a SONAME.
    headers=$(cd "$work/prefix/include/ferry" && ls | sort | tr '\n' ' ')
    public=$(cd "$src/src/include/ferry" && ls *.hpp ferry.h | sort | tr '\n' ' ')
    echo "installed headers: $headers"
    [ "$headers" = "$public" ] || { echo "expected the public headers: $public"; exit 1; }
    for h in ${headers/ferry.h/}; do
      grep -q "^#include <ferry/$h>" "$src/tests/consumer/main.cpp" ||
        { echo "tests/consumer/main.cpp does not include ferry/$h"; exit 1; }
    done
    lib=$(ls "$work"/prefix/lib*/libferry.so)
    soname=$(readelf -d "$lib" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')
    echo "SONAME: $soname"
    [[ "$soname" == libferry.so.* ]] || { echo "libferry.so has no versioned SONAME"; exit 1; }
    "$work/prefix/bin/ferry" --help > /dev/null
    # The C ABI: a C program built against the installed header and library.
    clib=$(dirname "$lib")
    cc -std=c99 -Wall -Wextra -Werror -I"$work/prefix/include" "$src/tests/consumer/main.c" \
      -L"$clib" -lferry_c -Wl,-rpath,"$clib" -o "$work/c_consumer"
    "$work/c_consumer" "$work/croot"
    cmake -S "$src/tests/consumer" -B "$work/b" "${gen[@]}" -DCMAKE_PREFIX_PATH="$work/prefix" \
      > "$work/configure.log"
    ;;
  subdir)
    # Compiles all of Ferry a second time (a few minutes on 2 cores): CI runs
    # it (FERRY_SLOW_TESTS=1); elsewhere ctest reports it skipped, not passed.
    if [ "${FERRY_SLOW_TESTS:-0}" != 1 ]; then
      echo "SKIP: set FERRY_SLOW_TESTS=1 to build Ferry again through add_subdirectory"
      exit 77
    fi
    cmake -S "$src/tests/consumer" -B "$work/b" "${gen[@]}" -DFERRY_SOURCE_DIR="$src" \
      > "$work/configure.log"
    ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
cmake --build "$work/b" -j 2 --target consumer > "$work/build.log" || { cat "$work/build.log"; exit 1; }
"$work/b/consumer" "$work/root"
