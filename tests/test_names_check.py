"""Every Catch2 test name survives ctest: catch_discover_tests splits a name
at a semicolon (a CMake list), and the halves then match no test, so a case
named with one never runs under ctest while the suite still passes."""

import glob
import os
import re
import sys

src = sys.argv[1]
bad = []
for path in sorted(glob.glob(os.path.join(src, "tests", "**", "*.cpp"), recursive=True)):
    text = open(path, encoding="utf-8").read()
    for m in re.finditer(r'TEST_CASE\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)', text):
        name = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1)))
        if ";" in name:
            line = text.count("\n", 0, m.start()) + 1
            bad.append("%s:%d: %s" % (os.path.relpath(path, src), line, name))
for b in bad:
    print("test name with a semicolon (ctest splits it):", b)
sys.exit(1 if bad else 0)
