#!/usr/bin/env bash
# libferry.so exports its public API and nothing else. Every dynamic symbol it
# defines must belong to a name the public headers (src/include/ferry/) mark
# FERRY_EXPORT: an exported class (its members, typeinfo, vtable) or free
# function, in namespace ferry or a namespace of its own there; never
# ferry::detail nor a class's Impl. And each of those names is exported.
# Usage: exported_symbols.sh LIBFERRY_SO SOURCE_DIR
set -euo pipefail
lib=$1 src=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/ferry-symbols-XXXXXX")
trap 'rm -rf "$work"' EXIT

# The public headers as one line without comments, so a declaration that
# clang-format broke over lines reads whole.
for h in "$src"/src/include/ferry/*.hpp; do
  [ "$(basename "$h")" = export_macro.hpp ] || sed 's://.*$::' "$h"
done | tr '\n' ' ' > "$work/headers"
ident='[A-Za-z_][A-Za-z0-9_]*'
{
  grep -oE "(class|struct) (\[\[[^]]*\]\] )*FERRY_EXPORT $ident" "$work/headers" | awk '{ print $NF }'
  grep -oE "FERRY_EXPORT [^;{}()]*$ident *\\(" "$work/headers" | sed -E 's/ *\($//; s/.*[^A-Za-z0-9_]//'
} | sort -u > "$work/names"
grep -oE "namespace $ident" "$work/headers" | awk '$2 != "ferry" && $2 != "detail" { print $2 }' |
  sort -u > "$work/namespaces"
[ -s "$work/names" ] || { echo "no FERRY_EXPORT declaration found in $src/src/include/ferry"; exit 1; }

nm -D --defined-only "$lib" | awk '{ print $NF }' > "$work/raw"
c++filt < "$work/raw" > "$work/demangled"
total=$(wc -l < "$work/raw")
bad=0
# One awk pass: a few thousand symbols before visibility was set.
paste "$work/raw" "$work/demangled" |
  awk -F'\t' -v names="$work/names" -v spaces="$work/namespaces" -v seen="$work/seen" '
    BEGIN {
      while ((getline n < names) > 0) public[n] = 1
      while ((getline n < spaces) > 0) space[n] = 1
      printf "" > seen
    }
    $1 ~ /^(_init|_fini|_edata|_end|__bss_start)$/ { next }  # made by the linker
    {
      name = $2
      # Special symbols name the class or function they belong to.
      sub(/^(typeinfo name for |typeinfo for |vtable for |VTT for |construction vtable for |non-virtual thunk to |virtual thunk to |guard variable for )/, "", name)
      if (name !~ /^ferry::/) { print "not Ferry'"'"'s: " name; bad++; next }
      # "ferry::Status* std::__do_uninit_copy<...>(...)": a return type first.
      if (name ~ /^ferry::[A-Za-z0-9_:]*[*&]* [A-Za-z_]/) {
        print "not Ferry'"'"'s (a template over a Ferry type): " name; bad++; next
      }
      in_ferry++
      # The qualified name up to the parameters or template arguments.
      path = substr(name, 8)
      gsub(/\[abi:[a-z0-9]+\]/, "", path)
      sub(/[(< ].*$/, "", path)
      k = split(path, parts, "::")
      i = 1
      while (i <= k && (parts[i] in space)) i++
      top = parts[i]
      if (!(top in public)) {
        print "not public API (" top " is no FERRY_EXPORT name of src/include/ferry/): " name
        bad++; next
      }
      if (("::" path "::") ~ /::(detail|Impl)::/) { print "an internal of a public class: " name; bad++; next }
      print top > seen
    }
    END { print in_ferry + 0 > (seen ".count"); exit bad > 0 }' > "$work/offenders" || bad=1
in_ferry=$(cat "$work/seen.count")
head -n 30 "$work/offenders"
[ "$(wc -l < "$work/offenders")" -le 30 ] || echo "... $(wc -l < "$work/offenders") in all"

# The other way: a name the headers export that the library does not (a
# declaration whose definition is hidden or missing) fails a user's link.
missing=$(sort -u "$work/seen" | comm -23 "$work/names" -)
if [ -n "$missing" ]; then
  echo "declared FERRY_EXPORT but not exported by $(basename "$lib"): $(echo $missing)"
  bad=$((bad + 1))
fi
echo "$(basename "$lib"): $total dynamic symbols defined, $in_ferry in ferry::," \
  "$(wc -l < "$work/names") public names"
[ $bad -eq 0 ] || { echo "FAIL: libferry.so exports more or less than its public API"; exit 1; }
