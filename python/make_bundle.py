#!/usr/bin/env python3
"""Assembles a self-contained copy of the ferry package for a machine that
has none of Debian's CAF, UCX, Cap'n Proto or xxhash (a GPU node with its
own Python and torch):

    python3 python/make_bundle.py build/lib/libferry_c.so OUT
    PYTHONPATH=OUT python3 -c "import ferry"

OUT/ferry/ holds the package, libferry_c.so and every non-system library it
needs (found with ldd; libferry_c.so's relative rpath $ORIGIN finds them),
and ucx/ with UCX's transport modules (the package points UCX_MODULE_DIR at
it when the variable is unset). glibc, libstdc++ and libgcc_s are left to
the target machine, which has newer ones."""

import os
import shutil
import subprocess
import sys

SYSTEM = ("linux-vdso", "libc.so", "libm.so", "libstdc++.so", "libgcc_s.so", "ld-linux",
          "libpthread.so", "libdl.so", "librt.so")
UCX_MODULES = "/usr/lib/x86_64-linux-gnu/ucx"


def deps(path):
    out = subprocess.run(["ldd", path], stdout=subprocess.PIPE, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            name, real = parts[0], parts[2]
            if not name.startswith(SYSTEM):
                found.append((name, real))
    return found


def bundle(lib, out):
    """Assembles OUT/ferry from `lib`; returns the names of the libraries
    copied beside it."""
    here = os.path.dirname(os.path.abspath(__file__))
    pkg = os.path.join(out, "ferry")
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(os.path.join(here, "ferry"), pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy2(lib, os.path.join(pkg, "libferry_c.so"))
    todo = [os.path.join(pkg, "libferry_c.so")]
    if os.path.isdir(UCX_MODULES):
        ucx = os.path.join(pkg, "ucx")
        os.makedirs(ucx)
        for name in os.listdir(UCX_MODULES):
            if name.endswith(".so.0"):
                shutil.copy2(os.path.join(UCX_MODULES, name), os.path.join(ucx, name))
                todo.append(os.path.join(ucx, name))
    copied = set()
    while todo:
        for name, real in deps(todo.pop()):
            if name not in copied:
                copied.add(name)
                dst = os.path.join(pkg, name)
                shutil.copy2(real, dst)
                todo.append(dst)
    return sorted(copied)


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    copied = bundle(sys.argv[1], sys.argv[2])
    print("bundle in %s: %s" % (os.path.join(sys.argv[2], "ferry"), ", ".join(copied)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
