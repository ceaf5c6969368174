#!/usr/bin/env bash
# The architecture as include rules, checked on every test run:
#   src/ (the pure core) includes nothing from actors/, CAF or UCX, nor a
#   drill (src/drills/) outside the drills: the core announces crash points
#   to its filesystem and never knows who observes them; nor the facade
#   (ferry/runtime.hpp, or a public header that includes it): the core reads
#   the value types (ferry/save_options.hpp, save_plan.hpp, ...) only;
#   a public header (src/include/ferry/) includes only the standard library
#   and other public headers, so the installed package stands alone;
#   tools/ (the CLI) includes only public headers and its own: what the CLI
#   does, a user can do through the public API.
set -uo pipefail
src=$1
bad=0
while IFS= read -r hit; do
  echo "src/ reaches the runtime: $hit"
  bad=1
done < <(grep -rnE '#include [<"]([^>"]*/)?(actors|caf|ucp|ucs|uct)/' "$src/src" --include='*.hpp' \
           --include='*.cpp' --include='*.h' | sed "s|$src/||")
while IFS= read -r hit; do
  echo "src/ reaches the drills: $hit"
  bad=1
done < <(grep -rnE '#include [<"]([^>"]*/)?drills/' "$src/src" --include='*.hpp' --include='*.cpp' \
           --include='*.h' --exclude-dir=drills | sed "s|$src/||")
# The facade: runtime.hpp and every public header that includes it, to a fixed point.
facade="runtime.hpp"
while :; do
  more=$(cd "$src/src/include/ferry" && grep -lE "#include \"ferry/($(tr ' ' '|' <<< "$facade"))\"" \
           *.hpp | sort -u | tr '\n' ' ' | sed 's/ $//')
  merged=$(tr ' ' '\n' <<< "$facade $more" | sort -u | tr '\n' ' ' | sed 's/ $//')
  [ "$merged" = "$facade" ] && break
  facade=$merged
done
while IFS= read -r hit; do
  echo "src/ reaches the facade (ferry/{${facade// /,}}): $hit"
  bad=1
done < <(grep -rnE "#include [<\"]ferry/($(tr ' ' '|' <<< "$facade"))[>\"]" "$src/src" \
           --include='*.hpp' --include='*.cpp' --include='*.h' --exclude-dir=include |
         sed "s|$src/||")
for h in "$src"/src/include/ferry/*; do
  while IFS= read -r inc; do
    name=$(sed -E 's/#include [<"]([^>"]+)[>"].*/\1/' <<< "$inc")
    case "$name" in
      ferry/*) [ -f "$src/src/include/$name" ] || { echo "${h#$src/}: $name is not public"; bad=1; } ;;
      */*|*.hpp|*.h)
        # C and C++ standard headers only (stdint.h, stddef.h for ferry.h).
        case "$name" in stdint.h|stddef.h) ;; *) echo "${h#$src/}: includes $name"; bad=1 ;; esac ;;
    esac
  done < <(grep -E '^#include ' "$h")
done
while IFS= read -r hit; do
  name=$(sed -E 's/.*#include "([^"]+)".*/\1/' <<< "$hit")
  case "$name" in
    ferry/*) [ -f "$src/src/include/$name" ] && continue ;;
    tools/*) [ -f "$src/$name" ] && continue ;;
  esac
  echo "tools/ reaches an internal header: ${hit#$src/}"
  bad=1
done < <(grep -rnE '^#include "' "$src/tools" --include='*.hpp' --include='*.cpp' --include='*.h')
[ $bad = 0 ] && echo "include rules hold: src/ -> no actors/CAF/UCX/drills/facade; public headers stand alone;" \
  "tools/ -> public headers only"
exit $bad
