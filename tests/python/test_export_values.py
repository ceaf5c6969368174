"""ferry export carries every Python value of the state (issue 41, 3): JSON
leaves, the typed encoding (tuples, bytes) and pickled values (copied as
stored, never unpickled) travel in the files' __metadata__; per-rank values
come out as their tensors. And SavePlanner checks mutations as save_async
does (on_mutation)."""

import json
import os
import shutil
import struct
import sys
import tempfile
import unittest

import _support  # noqa: F401 (exits 77, skipped, without torch)
import torch  # noqa: E402

import ferry
from ferry import _tree

ferry.configure(pool_bytes="16MiB", chunk_bytes="256KiB")


class Opaque:
    """Neither JSON nor the typed encoding: pickled."""

    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.x == self.x


def header_meta(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)).get("__metadata__", {})


class ExportValues(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ferry_py_export_values_")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_typed_and_pickled_values_travel(self):
        sd = {"w": torch.ones(3), "epoch": 4, "betas": (0.9, 0.99), "blob": b"\x00\x01",
              "obj": Opaque(7), "pos": ferry.per_rank({"i": 5})}
        root = os.path.join(self.tmp, "ckpt")
        ferry.save(sd, root, 1)
        out = os.path.join(self.tmp, "hf")
        index = ferry.export(root, out)
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = set(weight_map.values())
        self.assertEqual(set(weight_map), {"w", "pos.i@rank0"})
        for name in files:
            meta = header_meta(os.path.join(out, name))
            self.assertEqual(json.loads(meta["ferry.leaves"]), {"epoch": 4})
            values = json.loads(meta["ferry.values"])
            self.assertEqual({k: _tree._decode(k, e) for k, e in values.items()
                              if k != "obj"}, {"betas": (0.9, 0.99), "blob": b"\x00\x01"})
            obj = _tree._decode("obj", values["obj"])
            self.assertIsInstance(obj, _tree.Pickled)  # carried, not unpickled
            self.assertEqual(_tree.unpickle("obj", obj), Opaque(7))
            self.assertEqual(json.loads(meta["ferry.pickled"]), ["obj"])
            self.assertEqual(json.loads(meta["ferry.per_rank"]), {"pos.i": "value"})


class PlannerMutation(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ferry_py_planner_mutation_")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _planned(self, on_mutation):
        w = torch.zeros(1 << 16)
        p = ferry.SavePlanner({"w": w}, "ckpt", root=self.tmp, step=None,
                              on_mutation=on_mutation)
        plans = p.create_global_plan()
        w.add_(1)  # before this rank's snapshot: the checkpoint would be torn
        p.save_on_this_process(plans[0])
        return p

    def test_mutation_fails_the_checkpoint_naming_the_tensor(self):
        p = self._planned("error")
        with self.assertRaises(ferry.FerryError) as e:
            p.barrier()
        self.assertIn("tensor 'w' (version 0 -> 1) was changed in place", str(e.exception))
        self.assertIsNone(ferry.latest(self.tmp))

    def test_warn_commits_and_says_so(self):
        p = self._planned("warn")
        path = p.barrier()
        self.assertTrue(path)
        self.assertEqual(len(p.warnings()), 1)
        self.assertIn("'w'", p.warnings()[0])

    def test_bad_on_mutation_is_refused(self):
        with self.assertRaises(ferry.FerryError) as e:
            ferry.SavePlanner({"w": torch.zeros(2)}, "ckpt", root=self.tmp, on_mutation="nope")
        self.assertIn("on_mutation = 'nope'", str(e.exception))


if __name__ == "__main__":
    sys.exit(0 if unittest.main(exit=False).result.wasSuccessful() else 1)
