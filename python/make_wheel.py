#!/usr/bin/env python3
"""Builds the ferry wheel from a built libferry_c.so:

    cmake --build build --target ferry_c
    python3 python/make_wheel.py build/lib/libferry_c.so dist
    pip install dist/ferry-*.whl

The wheel holds what make_bundle.py assembles (the package, libferry_c.so
and every non-system library it needs, UCX's transport modules) with debug
information stripped, and is tagged for this platform
(py3-none-linux_x86_64): the native code is this machine's, so the wheel
says so, and installs on machines with this architecture and a glibc and
libstdc++ at least as new, without Debian's CAF, UCX or Cap'n Proto.
Prints the wheel's path."""

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_bundle  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def project():
    """(name, version, summary, requires-python) from pyproject.toml."""
    text = open(os.path.join(HERE, "pyproject.toml")).read()

    def field(key):
        m = re.search(r'^%s\s*=\s*"([^"]*)"' % key, text, re.M)
        if not m:
            raise SystemExit("pyproject.toml: no %s" % key)
        return m.group(1)

    return field("name"), field("version"), field("description"), field("requires-python")


def platform_tag():
    return re.sub(r"[^A-Za-z0-9]", "_", sysconfig.get_platform())


def digest(data):
    h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "sha256=" + h


def build(lib, out_dir):
    name, version, summary, requires = project()
    tag = "py3-none-" + platform_tag()
    tmp = tempfile.mkdtemp(prefix="ferry-wheel-")
    try:
        make_bundle.bundle(lib, tmp)
        pkg = os.path.join(tmp, "ferry")
        for root, _, files in os.walk(pkg):
            for f in files:
                if ".so" in f:
                    subprocess.run(["strip", "--strip-unneeded", os.path.join(root, f)],
                                   check=True)
        info = "%s-%s.dist-info" % (name, version)
        meta = {
            info + "/METADATA": "Metadata-Version: 2.1\nName: %s\nVersion: %s\nSummary: %s\n"
                                "Requires-Python: %s\nProvides-Extra: torch\n"
                                "Requires-Dist: torch>=1.13; extra == \"torch\"\n"
                                % (name, version, summary, requires),
            info + "/WHEEL": "Wheel-Version: 1.0\nGenerator: ferry make_wheel.py\n"
                             "Root-Is-Purelib: false\nTag: %s\n" % tag,
        }
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "%s-%s-%s.whl" % (name, version, tag))
        record = []
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            files = []
            for root, _, names in os.walk(pkg):
                for f in names:
                    if f.endswith(".pyc"):
                        continue
                    full = os.path.join(root, f)
                    files.append((os.path.relpath(full, tmp), full))
            for arc, full in sorted(files):
                data = open(full, "rb").read()
                zi = zipfile.ZipInfo(arc, date_time=(2020, 1, 1, 0, 0, 0))
                zi.external_attr = (os.stat(full).st_mode & 0o777) << 16
                zi.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(zi, data)
                record.append("%s,%s,%d" % (arc, digest(data), len(data)))
            for arc, text in sorted(meta.items()):
                data = text.encode()
                z.writestr(zipfile.ZipInfo(arc, date_time=(2020, 1, 1, 0, 0, 0)), data)
                record.append("%s,%s,%d" % (arc, digest(data), len(data)))
            record.append(info + "/RECORD,,")
            z.writestr(zipfile.ZipInfo(info + "/RECORD", date_time=(2020, 1, 1, 0, 0, 0)),
                       "\n".join(record) + "\n")
        return path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    print(build(sys.argv[1], sys.argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
