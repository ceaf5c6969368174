#!/usr/bin/env bash
# The README's checkable statements match the tree: the number of kill
# points it gives, every repository path it names, every CLI command it
# lists, and the C ABI files it says the install holds.
#   readme_check.sh SOURCE_DIR FERRY_CLI
set -euo pipefail
src=$1 cli=$2
readme="$src/README.md"
fail=0
bad() { echo "README: $*"; fail=1; }

said=$(grep -oE 'lists the [0-9]+ points' "$readme" | grep -oE '[0-9]+' || true)
have=$("$cli" kill-points | grep -c '^  ')
[ -n "$said" ] || bad "no kill-point count found ('lists the N points')"
[ -z "$said" ] || [ "$said" = "$have" ] || bad "says $said kill points, ferry kill-points lists $have"

for p in $(grep -oE '(docs|examples|config|bench|tests|scripts|schemas|src|tools|python|mk)/[A-Za-z0-9_./-]*[A-Za-z0-9_]' "$readme" | sort -u); do
  [ -e "$src/$p" ] || bad "names $p, which is not in the tree"
done

help=$("$cli" --help 2>&1 || true)
for c in $(sed -n '/^## CLI/,/^## /p' "$readme" | grep -oE '^ferry [a-z-]+' | awk '{print $2}' | sort -u); do
  [ "$c" = CMD ] && continue
  grep -qE "^ +$c( |$)" <<<"$help" || bad "lists 'ferry $c', which ferry --help does not know"
done

if grep -q 'ferry/ferry.h' "$readme"; then
  grep -q 'ferry.h' "$src/cmake/install.cmake" || bad "says ferry.h is installed; cmake/install.cmake does not install it"
  grep -qE 'TARGETS ferry_c' "$src/cmake/install.cmake" || bad "says libferry_c.so is installed; cmake/install.cmake does not install it"
fi
[ $fail = 0 ] && echo "README statements match the tree ($have kill points)"
exit $fail
