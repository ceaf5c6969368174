"""python/make_wheel.py: the wheel carries this platform's tag and a stripped
library, its RECORD matches its files, and the package unpacked from it
saves and loads on its own (FERRY_LIB unset), mapping its libraries from
where the wheel put them (test_bundle's check)."""

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

from _support import SRC  # noqa: E402 (exits 77, skipped, without torch)
# What a bundle's process checks holds for the unpacked wheel, which is one.
from test_bundle import CHILD  # noqa: E402



def has_debug_info(path):
    out = subprocess.run(["readelf", "-S", "-W", path], check=True, stdout=subprocess.PIPE,
                         text=True).stdout
    return ".debug_info" in out


def main():
    tmp = tempfile.mkdtemp(prefix="ferry_py_wheel_")
    try:
        dist = os.path.join(tmp, "dist")
        got = subprocess.run([sys.executable, os.path.join(SRC, "python", "make_wheel.py"),
                              os.environ["FERRY_LIB"], dist], check=True,
                             stdout=subprocess.PIPE, text=True).stdout.split()[-1]
        plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        assert os.path.basename(got).endswith("-py3-none-%s.whl" % plat), got
        with zipfile.ZipFile(got) as z:
            names = z.namelist()
            info = [n for n in names if n.endswith(".dist-info/WHEEL")]
            assert len(info) == 1, names
            wheel = z.read(info[0]).decode()
            assert "Root-Is-Purelib: false" in wheel and "Tag: py3-none-" + plat in wheel, wheel
            record = z.read(info[0].replace("WHEEL", "RECORD")).decode().splitlines()
            listed = {}
            for line in record:
                arc, h, size = line.rsplit(",", 2)
                listed[arc] = (h, size)
            assert set(listed) == set(names), set(listed) ^ set(names)
            for arc, (h, size) in listed.items():
                if not h:
                    continue
                data = z.read(arc)
                want = "sha256=" + base64.urlsafe_b64encode(
                    hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert h == want and int(size) == len(data), arc
            assert {"ferry/libferry_c.so", "ferry/__init__.py", "ferry/py.typed"} <= set(names), names
            site = os.path.join(tmp, "site")
            z.extractall(site)
        lib = os.path.join(site, "ferry", "libferry_c.so")
        assert not has_debug_info(lib), "the wheel's library keeps its debug information"
        assert os.path.getsize(lib) <= os.path.getsize(os.environ["FERRY_LIB"])
        os.chmod(lib, 0o755)
        env = {k: v for k, v in os.environ.items() if k not in ("FERRY_LIB", "LD_LIBRARY_PATH")}
        env["PYTHONPATH"] = site
        p = subprocess.run([sys.executable, "-c", CHILD, os.path.join(tmp, "ckpt"), site],
                           env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=120)
        print(p.stdout)
        assert p.returncode == 0 and "bundle ok: " + site in p.stdout, "the unpacked wheel failed"
        print("wheel:", os.path.basename(got), os.path.getsize(got), "bytes")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
