"""ferry.export: a checkpoint saved as shards by two ranks' worth of keys is
written consolidated (full global shapes) as safetensors files with a
model.safetensors.index.json; every tensor read back matches. Read with the
`safetensors` package when it is installed, and always with an independent
reader of the format (8-byte header length, JSON header, data)."""

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

import _support  # noqa: F401 (exits 77, skipped, without torch)
import torch  # noqa: E402

import ferry

ferry.configure(pool_bytes="16MiB", chunk_bytes="256KiB")

DT = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
      "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    end = 0
    for name, e in header.items():
        a, b = e["data_offsets"]
        buf = bytearray(raw[8 + n + a:8 + n + b])
        dt = DT[e["dtype"]]
        t = torch.frombuffer(buf, dtype=dt) if buf else torch.empty(0, dtype=dt)
        out[name] = t.reshape(e["shape"])
        end = max(end, b)
    assert 8 + n + end == len(raw), "trailing bytes in %s" % path
    return out, meta


class Export(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ferry_py_export_")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_consolidated(self):
        g = torch.Generator().manual_seed(5)
        full = {
            "emb": torch.randn(300, 64, generator=g),
            "ln.bias": torch.randn(64, generator=g).to(torch.bfloat16),
            "count": torch.tensor(17, dtype=torch.int64),
            "mask": torch.rand(9, generator=g) > 0.5,
            "q": torch.randint(-100, 100, (4, 5), generator=g, dtype=torch.int8),
        }
        sd = dict(full)
        sd["emb"] = ferry.Shard(full["emb"], (300, 64), (0, 0))
        sd["epoch"] = 2
        root = os.path.join(self.tmp, "ckpt")
        ferry.save(sd, root, 40)
        out = os.path.join(self.tmp, "hf")
        # block_bytes below emb's 75 KiB: it is loaded and written in row blocks.
        index = ferry.export(root, out, max_shard_bytes=40_000, block_bytes=10_000)
        self.assertEqual(os.path.basename(index), "model.safetensors.index.json")
        with open(index) as f:
            idx = json.load(f)
        self.assertEqual(set(idx["weight_map"]), set(full))
        files = sorted(set(idx["weight_map"].values()))
        self.assertGreater(len(files), 1)  # split by max_shard_bytes
        self.assertTrue(all(n.endswith("-of-%05d.safetensors" % len(files)) for n in files))
        total = sum(t.numel() * t.element_size() for t in full.values())
        self.assertEqual(idx["metadata"]["total_size"], total)
        got = {}
        for name in files:
            tensors, meta = read_safetensors(os.path.join(out, name))
            self.assertEqual(meta["ferry.step"], "40")
            self.assertEqual(json.loads(meta["ferry.leaves"]), {"epoch": 2})
            for k in tensors:
                self.assertEqual(idx["weight_map"][k], name)
            got.update(tensors)
        for k, t in full.items():
            self.assertEqual(got[k].dtype, t.dtype, k)
            self.assertTrue(torch.equal(got[k], t), k)
        try:
            from safetensors.torch import load_file
        except ImportError:
            print("(safetensors package not installed: checked with the reader above)")
        else:
            for name in files:
                for k, t in load_file(os.path.join(out, name)).items():
                    self.assertTrue(torch.equal(t, full[k]), k)

    def test_cli_writes_what_python_writes(self):
        # `ferry export` (the CLI) and ferry.export are one piece of code: the
        # same files, byte for byte, the non-tensor values included.
        root = os.path.join(self.tmp, "same")
        ferry.save({"w": torch.arange(12.0).reshape(3, 4), "epoch": 3, "cfg": {"lr": 0.5}}, root, 9)
        py_out, cli_out = os.path.join(self.tmp, "py"), os.path.join(self.tmp, "cli")
        ferry.export(root, py_out)
        p = subprocess.run([os.environ["FERRY_CLI"], "export", root, cli_out],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(sorted(os.listdir(py_out)), sorted(os.listdir(cli_out)))
        for name in os.listdir(py_out):
            with open(os.path.join(py_out, name), "rb") as a, open(os.path.join(cli_out, name), "rb") as b:
                self.assertEqual(a.read(), b.read(), name)
        _, meta = read_safetensors(os.path.join(cli_out, "model-00001-of-00001.safetensors"))
        self.assertEqual(json.loads(meta["ferry.leaves"]), {"epoch": 3, "cfg.lr": 0.5})

    def test_cli_module(self):
        ferry.save({"w": torch.ones(3)}, os.path.join(self.tmp, "c"), 1)
        env = dict(os.environ)
        p = subprocess.run([sys.executable, "-m", "ferry", "export", os.path.join(self.tmp, "c"),
                            os.path.join(self.tmp, "o")], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        tensors, _ = read_safetensors(os.path.join(self.tmp, "o", "model-00001-of-00001.safetensors"))
        self.assertTrue(torch.equal(tensors["w"], torch.ones(3)))
        p = subprocess.run([sys.executable, "-m", "ferry", "export", os.path.join(self.tmp, "none"),
                            os.path.join(self.tmp, "o2")], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=120)
        self.assertEqual(p.returncode, 1)
        self.assertIn("ferry export:", p.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
