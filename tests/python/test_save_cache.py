"""Runtime.save_async's cache of a state dict it saw before
(ferry/_save_cache.py): a repeated save hands the C ABI what a cold one
would, and everything that can change between two saves of one dict (the
tensor set, a shape, a dtype, a data pointer, a storage, contiguity, a JSON
leaf, the tree, the save's options) is seen: each test saves, changes one
thing, saves again and loads the second checkpoint back, byte for byte.

Run by ctest (exit 77 = skipped when torch is not importable)."""

import json
import os
import shutil
import tempfile
import unittest

import _support  # noqa: F401 (exits 77, skipped, without torch)
import torch  # noqa: E402

import ferry
from ferry import _core, _save_cache, _tree


def filled(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


def same_bytes(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


class Holder:
    """A stateful object (state_dict / load_state_dict) in the tree."""

    def __init__(self):
        self.w = filled((3, 2), seed=9)
        self.count = 4

    def state_dict(self):
        return {"w": self.w, "count": self.count}

    def load_state_dict(self, sd):
        self.w.copy_(sd["w"])
        self.count = sd["count"]


def trees():
    """State dicts of every shape the walk knows."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "flat": {"a": filled((4,)), "b.c": filled((2, 3), seed=1)},
        "nested": {"model": {"layer": {0: filled((2,)), "1": filled((3,), seed=2)}},
                   "lists": [filled((2,), seed=3), (filled((1,), seed=4), 5)],
                   "leaves": {"epoch": 3, "name": "run", "none": None, "ints": [1, 2],
                              "empty": {}},
                   "scalar": torch.tensor(2.5)},
        "stateful": {"holder": Holder(), "model": model, "optim": opt, "step": 7},
        "shards": {"rows": ferry.Shard(filled((2, 4)), (6, 4), (2, 0)),
                   "whole": filled((3,), seed=5)},
    }


class Base(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="ferry-save-cache-")
        self.rt = ferry.Runtime({"pool_bytes": "16MiB", "chunk_bytes": "1MiB"}, rank=0,
                                world_size=1)
        self.step = 0

    def tearDown(self):
        self.rt.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def save(self, sd, options=None, metadata=None):
        self.step += 1
        h = self.rt.save_async(sd, self.dir, self.step, options=options, metadata=metadata)
        return h.wait()

    def stats(self):
        return dict(self.rt._save_cache.stats)

    def assert_loads(self, path, expected):
        """Every tensor of `expected` (flat key -> tensor) loads back equal."""
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        self.rt.load(target, path)
        for k, v in expected.items():
            self.assertTrue(same_bytes(target[k], v), "%s differs after load" % k)


class SameOutput(unittest.TestCase):
    """The cold and the warm path give what _save_entries (flatten) gives."""

    def check(self, name, sd):
        items, staged, _, pairs = _core._save_entries(sd, {"user": "x"})
        cache = _save_cache.SaveCache()
        for path in ("cold", "warm"):
            p = cache.prepare(sd, {"user": "x"})
            self.assertEqual(cache.stats[path], 1, "%s: the %s path was not taken" % (name, path))
            self.assertEqual(p.pairs, pairs, "%s (%s): metadata differs" % (name, path))
            self.assertEqual(p.n, len(items), name)
            for t, (key, ref, _, _) in zip(p.tensors, items):
                self.assertEqual(t.data_ptr(), ref.data_ptr(), "%s (%s): %s" % (name, path, key))
                self.assertEqual(t.shape, ref.shape, "%s (%s): %s" % (name, path, key))
            self.assertEqual(p.staged, staged, name)
        cache.clear()

    def test_every_tree(self):
        for name, sd in trees().items():
            self.check(name, sd)

    def test_model_state_dict_is_a_new_dict_each_time_and_still_warm(self):
        model = torch.nn.Linear(5, 4)
        cache = _save_cache.SaveCache()
        cache.prepare(model.state_dict(), None)
        cache.prepare(model.state_dict(), None)
        self.assertEqual(cache.stats, {"cold": 1, "warm": 1, "replaced": 0})
        cache.clear()

    def test_what_flatten_refuses_is_refused_the_same(self):
        cache = _save_cache.SaveCache()
        for bad, err in (({"a": object()}, TypeError), ({True: filled((1,))}, TypeError),
                         ({1: filled((1,)), "1": filled((1,))}, ValueError)):
            with self.assertRaises(err) as ref:
                _tree.flatten(bad)
            with self.assertRaises(err) as got:
                cache.prepare(bad, None)
            self.assertEqual(str(got.exception), str(ref.exception))
        # And after a good save, the same errors from the warm side.
        good = {"a": filled((1,))}
        cache.prepare(good, None)
        good["a"] = object()
        with self.assertRaises(TypeError):
            cache.prepare(good, None)
        cache.clear()


class Records(unittest.TestCase):
    """The packed ferry_tensor records say what each tensor is."""

    def test_records_of_every_kind(self):
        base = filled((4, 6))
        items = [("plain", filled((2, 3)), None, None),
                 ("scalar", torch.tensor(1.5, dtype=torch.float64), None, None),
                 ("empty", torch.zeros(0, 5, dtype=torch.int8), None, None),
                 ("strided", base.t(), None, None),
                 ("shard", base[1:3], (8, 6), (4, 0))]
        e = _core._Entries(items)
        codes, _ = _core._dtype_tables()
        for i, (key, t, g, o) in enumerate(items):
            r = e.array[i]
            nd = t.dim()
            self.assertEqual(r.key.decode(), key)
            self.assertEqual(r.data or 0, t.data_ptr() if t.numel() else 0, key)
            self.assertEqual(r.dtype, codes[t.dtype], key)
            self.assertEqual(r.ndim, nd, key)
            self.assertEqual([r.shape[j] for j in range(nd)], list(t.shape), key)
            if t.is_contiguous():
                self.assertFalse(bool(r.strides), key)
            else:
                self.assertEqual([r.strides[j] for j in range(nd)], list(t.stride()), key)
            self.assertEqual((r.device_type, r.device_index), (0, 0), key)
            if g is None:
                self.assertFalse(bool(r.global_shape) or bool(r.offsets), key)
            else:
                self.assertEqual([r.global_shape[j] for j in range(nd)], list(g), key)
                self.assertEqual([r.offsets[j] for j in range(nd)], list(o), key)

    def test_bad_dtype_and_device_are_named(self):
        with self.assertRaisesRegex(ferry.FerryError, "tensor 'c'.*complex"):
            _core._Entries([("ok", filled((2,)), None, None),
                            ("c", torch.zeros(2, dtype=torch.complex64), None, None)])
        with self.assertRaisesRegex(ferry.FerryError, "tensor 'm'.*meta"):
            _core._Entries([("m", torch.empty(2, device="meta"), None, None)])


class Invalidation(Base):
    def test_repeated_save_is_warm(self):
        sd = {"a": filled((4,)), "b": filled((2, 2), seed=1)}
        self.save(sd)
        sd["a"].add_(1)  # new bytes, same tensor: nothing to replace
        path = self.save(sd)
        self.assertEqual(self.stats(), {"cold": 1, "warm": 1, "replaced": 0})
        self.assert_loads(path, sd)

    def test_tensor_set_changes(self):
        sd = {"a": filled((4,)), "b": filled((2,), seed=1)}
        self.save(sd)
        sd["c"] = filled((3,), seed=2)
        path = self.save(sd)
        self.assertEqual(self.stats()["cold"], 2)
        self.assert_loads(path, sd)
        self.assertEqual(sorted(ferry.read_manifest(path).tensors), ["a", "b", "c"])
        del sd["a"]
        path = self.save(sd)
        self.assertEqual(sorted(ferry.read_manifest(path).tensors), ["b", "c"])
        self.assert_loads(path, sd)

    def test_key_order_changes(self):
        sd = {"a": filled((4,)), "b": filled((2,), seed=1)}
        self.save(sd)
        sd2 = {"b": sd["b"], "a": sd["a"]}
        path = self.save(sd2)
        self.assertEqual(self.stats()["cold"], 2)
        self.assert_loads(path, sd2)

    def test_shape_changes(self):
        sd = {"a": filled((4, 3)), "b": filled((2,), seed=1)}
        self.save(sd)
        sd["a"] = filled((3, 5), seed=7)
        path = self.save(sd)
        self.assertEqual(self.stats(), {"cold": 1, "warm": 1, "replaced": 1})
        self.assertEqual(ferry.read_manifest(path).tensors["a"].shape, (3, 5))
        self.assert_loads(path, sd)

    def test_in_place_resize_keeps_the_pointer(self):
        sd = {"a": filled((4, 4)), "b": filled((2,), seed=1)}
        self.save(sd)
        ptr = sd["a"].data_ptr()
        sd["a"].resize_(2, 4)
        self.assertEqual(sd["a"].data_ptr(), ptr)
        path = self.save(sd)
        self.assertEqual(self.stats()["replaced"], 1)
        self.assertEqual(ferry.read_manifest(path).tensors["a"].shape, (2, 4))
        self.assert_loads(path, sd)

    def test_dtype_changes(self):
        sd = {"a": filled((4,)), "b": filled((2,), seed=1)}
        self.save(sd)
        sd["a"] = filled((4,), dtype=torch.float64, seed=3)
        path = self.save(sd)
        self.assertEqual(self.stats()["replaced"], 1)
        self.assertEqual(ferry.read_manifest(path).torch_dtype("a"), torch.float64)
        self.assert_loads(path, sd)

    def test_view_as_another_dtype_keeps_pointer_and_shape(self):
        sd = {"a": filled((4,)), "b": filled((2,), seed=1)}
        self.save(sd)
        sd["a"] = sd["a"].view(torch.int32)  # same bytes, same pointer and shape
        path = self.save(sd)
        self.assertEqual(self.stats()["replaced"], 1)
        self.assertEqual(ferry.read_manifest(path).torch_dtype("a"), torch.int32)
        self.assert_loads(path, sd)

    def test_data_pointer_changes(self):
        sd = {"a": filled((4,)), "b": filled((2,), seed=1)}
        self.save(sd)
        sd["a"] = filled((4,), seed=11)  # a new tensor, new memory
        path = self.save(sd)
        self.assertEqual(self.stats()["replaced"], 1)
        self.assert_loads(path, sd)

    def test_storage_swapped_under_the_same_tensor(self):
        sd = {"a": filled((4,)), "b": filled((2,), seed=1)}
        self.save(sd)
        sd["a"].set_(filled((4,), seed=12))
        path = self.save(sd)
        self.assertEqual(self.stats()["replaced"], 1)
        self.assert_loads(path, sd)

    def test_tensor_becomes_non_contiguous(self):
        sd = {"a": filled((3, 4)), "b": filled((2,), seed=1)}
        self.save(sd)
        sd["a"] = filled((4, 3), seed=13).t()
        h = self.rt.save_async(sd, self.dir, 99)
        self.assertEqual(h.staged, ["a"])
        path = h.wait()
        self.assert_loads(path, sd)
        sd["a"] = sd["a"].contiguous()
        path = self.save(sd)
        self.assert_loads(path, sd)

    def test_shard_changes(self):
        a = filled((2, 4))
        sd = {"s": ferry.Shard(a, (2, 4), (0, 0)), "b": filled((2,), seed=1)}
        self.save(sd)
        sd["s"] = ferry.Shard(filled((2, 4), seed=8), (2, 4), (0, 0))  # new memory
        path = self.save(sd)
        self.assertEqual(self.stats()["replaced"], 1)
        target = {"s": ferry.Shard(torch.zeros(2, 4), (2, 4), (0, 0)), "b": torch.zeros(2)}
        self.rt.load(target, path)
        self.assertTrue(same_bytes(target["s"].tensor, sd["s"].tensor))
        sd["s"] = ferry.Shard(a.view(8), (8,), (0,))  # a's memory again, another global shape
        path = self.save(sd)
        self.assertEqual(self.stats()["replaced"], 2)
        self.assertEqual(ferry.read_manifest(path).tensors["s"].shape, (8,))
        target = {"s": torch.zeros(8), "b": torch.zeros(2)}
        self.rt.load(target, path)
        self.assertTrue(same_bytes(target["s"], a.view(8)))

    def test_json_leaf_changes(self):
        sd = {"a": filled((4,)), "epoch": 1, "cfg": {"lr": 0.1}}
        self.save(sd)
        sd["epoch"] = 2
        sd["cfg"]["lr"] = 0.01
        path = self.save(sd)
        self.assertEqual(self.stats()["warm"], 1)
        target = {"a": torch.zeros(4), "epoch": 0, "cfg": {"lr": 0.0}}
        self.rt.load(target, path)
        self.assertEqual((target["epoch"], target["cfg"]["lr"]), (2, 0.01))
        # A leaf list that now holds a tensor is a container: the cold walk.
        sd["epoch"] = [filled((2,), seed=3)]
        path = self.save(sd)
        self.assertEqual(self.stats()["cold"], 2)
        self.assertIn("epoch.0", ferry.read_manifest(path).tensors)

    def test_stateful_objects_repeat(self):
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sd = {"model": model, "optim": opt}
        self.save(sd)  # no momentum buffers yet
        model(torch.randn(2, 4)).sum().backward()
        opt.step()  # now there are: the tree changed
        self.save(sd)
        with torch.no_grad():
            model.weight.add_(1)
        path = self.save(sd)
        self.assertEqual(self.stats(), {"cold": 2, "warm": 1, "replaced": 0})
        fresh = torch.nn.Linear(4, 3)
        self.rt.load({"model": fresh}, path, strict=False)
        self.assertTrue(same_bytes(fresh.weight, model.weight))

    def test_options_change_between_saves(self):
        sd = {"a": filled((256, 64)), "b": filled((64,), seed=1)}
        self.save(sd)
        path = self.save(sd, options=ferry.CheckpointOptions(compress="zstd:1"))
        self.assertTrue(any(f.endswith(".ferryz") for f in os.listdir(path)), os.listdir(path))
        self.assert_loads(path, sd)
        path = self.save(sd, options=ferry.CheckpointOptions(shard_size=16 << 10,
                                                             filename_prefix="shard"))
        data = [f for f in os.listdir(path) if f.startswith("shard-")]
        self.assertGreater(len(data), 1, os.listdir(path))
        self.assert_loads(path, sd)
        path = self.save(sd)
        self.assertFalse(any(f.startswith("shard-") for f in os.listdir(path)))
        self.assert_loads(path, sd)
        self.assertEqual(self.stats()["cold"], 1)

    def test_user_metadata_changes(self):
        sd = {"a": filled((4,))}
        self.save(sd, metadata={"run": "one"})
        path = self.save(sd, metadata={"run": "two"})
        self.assertEqual(ferry.read_manifest(path).user_metadata["run"], "two")

    def test_two_state_dicts_alternate(self):
        a = {"x": filled((4,))}
        b = {"y": filled((2,), seed=1), "z": filled((3,), seed=2)}
        for _ in range(2):
            pa = self.save(a)
            pb = self.save(b)
        self.assert_loads(pa, a)
        self.assert_loads(pb, b)
        self.assertEqual(sorted(ferry.read_manifest(pb).tensors), ["y", "z"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
