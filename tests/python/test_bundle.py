"""python/make_bundle.py: the package copied with libferry_c.so and its
non-system libraries into one folder works from there alone: a process
using it (FERRY_LIB unset) saves and loads, and maps CAF, UCX, Cap'n Proto
and xxhash from the bundle, not from the system (the relative rpath)."""

import os
import shutil
import subprocess
import sys
import tempfile

from _support import SRC  # noqa: E402 (exits 77, skipped, without torch)


CHILD = r"""
import os, sys, torch, ferry
ferry.configure(pool_bytes="8MiB")
root = sys.argv[1]
ferry.save({"w": torch.arange(6.0)}, root, 1)
out = {"w": torch.zeros(6)}
ferry.load(out, root)
assert torch.equal(out["w"], torch.arange(6.0))
maps = open("/proc/self/maps").read()
for lib in ("libferry_c.so", "libcaf_core", "libucp", "libcapnp", "libxxhash"):
    paths = {l.split()[-1] for l in maps.splitlines() if lib in l}
    assert paths and all(p.startswith(sys.argv[2]) for p in paths), (lib, paths)
print("bundle ok:", ferry.library_path())
"""


def main():
    tmp = tempfile.mkdtemp(prefix="ferry_py_bundle_")
    try:
        out = os.path.join(tmp, "bundle")
        subprocess.run([sys.executable, os.path.join(SRC, "python", "make_bundle.py"),
                        os.environ["FERRY_LIB"], out], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("FERRY_LIB", "LD_LIBRARY_PATH")}
        env["PYTHONPATH"] = out
        p = subprocess.run([sys.executable, "-c", CHILD, os.path.join(tmp, "ckpt"), out],
                           env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=120)
        print(p.stdout)
        assert p.returncode == 0 and "bundle ok: " + out in p.stdout, "bundle run failed"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
