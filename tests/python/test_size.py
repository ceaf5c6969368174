"""Sizes on the command line: ferry._size.parse_size (the flags of
`python3 -m ferry`) accepts and refuses the texts of tests/size_cases.txt as
ferry::parse_size does (tests/unit/options_test.cpp reads the same table),
and `python3 -m ferry export --max-shard-bytes` takes what `ferry export
--max-shard-bytes` takes, writes the same files, and names the flag when the
value is no size.

Run by ctest (exit 77 = skipped when torch is not importable)."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import _support  # noqa: F401 (exits 77, skipped, without torch)
import torch  # noqa: E402

import ferry
from ferry._size import parse_size

ferry.configure(pool_bytes="16MiB", chunk_bytes="256KiB")

ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v"}


def size_cases():
    """(text, bytes or None where refused) of tests/size_cases.txt."""
    path = os.path.join(_support.SRC, "tests", "size_cases.txt")
    cases = []
    with open(path, encoding="utf-8") as f:
        for line in f.read().split("\n"):
            if not line or line.startswith("#"):
                continue
            raw, want = line.rsplit("|", 1)
            text, i = "", 0
            while i < len(raw):
                if raw[i] == "\\" and i + 1 < len(raw):
                    i += 1
                    text += ESCAPES.get(raw[i], raw[i])
                else:
                    text += raw[i]
                i += 1
            cases.append((text, None if want == "refused" else int(want)))
    return cases


class Size(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ferry_py_size_")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_the_settings_cases(self):
        cases = size_cases()
        self.assertGreater(len(cases), 40)
        for text, want in cases:
            with self.subTest(text=text):
                if want is None:
                    with self.assertRaises(ValueError) as e:
                        parse_size(text)
                    self.assertIn("'%s' is not a size: " % text, str(e.exception))
                else:
                    self.assertEqual(parse_size(text), want)

    def run_cli(self, *argv):
        return subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, timeout=120)

    def test_export_flag_is_the_cli_flag(self):
        root = os.path.join(self.tmp, "ckpt")
        g = torch.Generator().manual_seed(3)
        ferry.save({"a": torch.randn(100, 50, generator=g), "b": torch.randn(100, 50, generator=g),
                    "c": torch.randn(10, generator=g)}, root, 7)
        py = [sys.executable, "-m", "ferry", "export"]
        cli = [os.environ["FERRY_CLI"], "export"]
        outs = {}
        for name, argv in (("py", py), ("cli", cli)):
            out = os.path.join(self.tmp, name)
            p = self.run_cli(*argv, root, out, "--max-shard-bytes", "20KB")
            self.assertEqual(p.returncode, 0, p.stderr)
            outs[name] = sorted(os.listdir(out))
        self.assertEqual(outs["py"], outs["cli"])
        # Split by the 20,000 bytes (the default, 5GiB, would write one file).
        self.assertGreater(len([n for n in outs["py"] if n.endswith(".safetensors")]), 1)
        for name in outs["py"]:
            with open(os.path.join(self.tmp, "py", name), "rb") as a, \
                    open(os.path.join(self.tmp, "cli", name), "rb") as b:
                self.assertEqual(a.read(), b.read(), name)
        # Refused by both, each naming the flag and the text, exit 2 (a usage error).
        for bad in ("1.5GiB", "12 parsecs", "-1", "0", "1\u212a"):
            for argv in (py, cli):
                with self.subTest(bad=bad, prog=argv[0]):
                    out = os.path.join(self.tmp, "never")
                    p = self.run_cli(*argv, root, out, "--max-shard-bytes", bad)
                    self.assertEqual(p.returncode, 2, p.stderr)
                    self.assertIn("--max-shard-bytes", p.stderr)
                    self.assertIn("'%s'" % bad, p.stderr)
                    self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    unittest.main()
