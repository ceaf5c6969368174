"""The ferry package in one process: round trips of every dtype, nested
dicts and JSON leaves, non-contiguous tensors, a module + optimizer into
fresh objects, strict / non-strict / cast / key_map, errors as FerryError,
shards (row, column, flat), CheckpointManager, and fork safety.

Run by ctest (exit 77 = skipped when torch is not importable)."""

import logging
import os
import shutil
import sys
import tempfile
import threading
import unittest

import _support  # noqa: F401 (exits 77, skipped, without torch)
import torch  # noqa: E402

import ferry

ferry.configure(pool_bytes="32MiB", chunk_bytes="1MiB")


def filled(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g,
                         dtype=torch.int64).to(dtype)


def same_bytes(a, b):
    """Bitwise equality (NaN-safe, -0.0 vs 0.0 told apart)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    ia = a.contiguous().reshape(-1).view(torch.uint8)
    ib = b.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(ia, ib)


DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


class Base(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="ferry_py_")

    def tearDown(self):
        shutil.rmtree(self.root, ignore_errors=True)


class RoundTrip(Base):
    def test_every_dtype(self):
        sd = {str(dt).replace("torch.", ""): filled((7, 5), dt, i) for i, dt in enumerate(DTYPES)}
        sd["scalar"] = torch.tensor(3.5, dtype=torch.float64)
        sd["empty"] = torch.empty(0, 4)
        h = ferry.save_async(sd, self.root, 1)
        path = h.wait()
        self.assertTrue(path.endswith("step-00000001"), path)
        self.assertTrue(h.done())
        man = ferry.read_manifest(self.root)
        self.assertEqual(man.step, 1)
        for k, v in sd.items():
            self.assertEqual(man.torch_dtype(k), v.dtype, k)
            self.assertEqual(man.tensors[k].shape, tuple(v.shape), k)
        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        res = ferry.load(target, self.root)
        self.assertEqual(res, ferry.LoadResult([], []))
        missing, unexpected = res
        self.assertEqual((missing, unexpected), ([], []))
        self.assertEqual(res.stats["step"], 1)
        self.assertEqual(res.stats["tensors_restored"], len(sd))
        nbytes = sum(v.numel() * v.element_size() for v in sd.values())
        self.assertGreaterEqual(res.stats["bytes_read"], nbytes)
        self.assertEqual(res.stats["bytes_received"], 0)
        for k in sd:
            self.assertTrue(same_bytes(sd[k], target[k]), k)

    def test_nested_and_json_leaves(self):
        sd = {
            "model": {"enc": {"w": filled((4, 4), torch.float32)}, "dec": {0: filled((3,), torch.int32)}},
            "epoch": 7,
            "lr": 0.125,
            "name": "run-1",
            "flag": True,
            "nothing": None,
            "sched": {"milestones": [10, 20], "gamma": 0.5},
            "hist": [filled((2,), torch.float16, 1), filled((2,), torch.float16, 2)],
        }
        ferry.save(sd, self.root, 3)
        target = {
            "model": {"enc": {"w": torch.zeros(4, 4)}, "dec": {0: torch.zeros(3, dtype=torch.int32)}},
            "epoch": 0,
            "lr": 0.0,
            "name": "",
            "flag": False,
            "nothing": 1,
            "sched": {"milestones": [], "gamma": 0.0},
            "hist": [torch.zeros(2, dtype=torch.float16), torch.zeros(2, dtype=torch.float16)],
        }
        ferry.load(target, self.root)
        self.assertTrue(torch.equal(target["model"]["enc"]["w"], sd["model"]["enc"]["w"]))
        self.assertTrue(torch.equal(target["model"]["dec"][0], sd["model"]["dec"][0]))
        self.assertEqual(target["epoch"], 7)
        self.assertEqual(target["lr"], 0.125)
        self.assertEqual(target["name"], "run-1")
        self.assertIs(target["flag"], True)
        self.assertIsNone(target["nothing"])
        self.assertEqual(target["sched"], {"milestones": [10, 20], "gamma": 0.5})
        self.assertTrue(torch.equal(target["hist"][1], sd["hist"][1]))
        # A new state dict rebuilt from the checkpoint, int keys and lists kept.
        fresh = ferry.load_state_dict(self.root)
        self.assertEqual(set(fresh), set(sd))
        self.assertIn(0, fresh["model"]["dec"])
        self.assertIsInstance(fresh["hist"], list)
        self.assertTrue(torch.equal(fresh["hist"][0], sd["hist"][0]))
        self.assertEqual(fresh["sched"]["milestones"], [10, 20])

    def test_non_contiguous_staged(self):
        base = filled((6, 8), torch.float32)
        sd = {"t": base.t(), "every_other": base[:, ::2], "narrow": base[1:4, 2:5]}
        for v in sd.values():
            self.assertFalse(v.is_contiguous())
        h = ferry.save_async(sd, self.root, 1)
        self.assertEqual(sorted(h.staged), ["every_other", "narrow", "t"])
        h.wait_snapshot()
        base.zero_()  # after the snapshot, the source may change
        h.wait()
        expect = filled((6, 8), torch.float32)
        # Non-contiguous targets are filled too.
        out_base = torch.zeros(6, 8)
        target = {"t": out_base.t(), "every_other": torch.zeros(6, 4), "narrow": torch.zeros(3, 3)}
        ferry.load(target, self.root)
        self.assertTrue(torch.equal(out_base, expect))
        self.assertTrue(torch.equal(target["every_other"], expect[:, ::2]))
        self.assertTrue(torch.equal(target["narrow"], expect[1:4, 2:5]))

    def test_snapshot_before_mutation(self):
        w = filled((256, 256), torch.float32)
        keep = w.clone()
        h = ferry.save_async({"w": w}, self.root, 1)
        h.wait_snapshot()
        w.add_(1.0)
        h.wait()
        out = {"w": torch.empty(256, 256)}
        ferry.load(out, self.root)
        self.assertTrue(torch.equal(out["w"], keep))
        m = h.metrics()
        self.assertGreater(m["total_ms"], 0)
        self.assertGreaterEqual(m["bytes"], 256 * 256 * 4)


class ModuleAndOptimizer(Base):
    def make(self, seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, opt

    def train(self, model, opt, steps, seed):
        g = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(steps):
            x = torch.randn(32, 8, generator=g)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    def test_restore_into_fresh_objects(self):
        model, opt = self.make(0)
        self.train(model, opt, 5, 1)
        ferry.save({"model": model, "optim": opt, "step": 5}, self.root, 5)
        after = self.train(model, opt, 3, 2)

        model2, opt2 = self.make(123)  # different init, optimizer without state
        state = {"model": model2, "optim": opt2, "step": 0}
        ferry.load(state, self.root)
        self.assertEqual(state["step"], 5)
        after2 = self.train(model2, opt2, 3, 2)
        self.assertEqual(after, after2)
        for p, q in zip(model.parameters(), model2.parameters()):
            self.assertTrue(torch.equal(p, q))

    def test_plain_state_dicts(self):
        model, opt = self.make(0)
        self.train(model, opt, 2, 1)
        ferry.save({"model": model.state_dict()}, self.root, 1)
        model2, _ = self.make(9)
        ferry.load({"model": model2.state_dict()}, self.root)  # in place
        x = torch.randn(4, 8)
        self.assertTrue(torch.equal(model(x), model2(x)))


class Strictness(Base):
    def setUp(self):
        super().setUp()
        self.sd = {"a": filled((4,), torch.float32), "b": filled((2, 2), torch.float64), "n": 3}
        ferry.save(self.sd, self.root, 1)

    def test_strict_lists_every_key(self):
        target = {"a": torch.zeros(4), "c": torch.zeros(1), "m": 1}
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.load(target, self.root, strict=True)
        msg = str(cm.exception)
        for k in ("'c'", "c", "m", "b", "n"):
            self.assertIn(k.strip("'"), msg)
        self.assertIn("missing from the checkpoint: c, m", msg)
        self.assertIn("not in the state dict: b, n", msg)
        self.assertTrue(torch.equal(target["a"], torch.zeros(4)))  # nothing loaded

    def test_strict_true_refuses_a_subset(self):
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.load({"a": torch.zeros(4)}, self.root, strict=True)
        self.assertIn("not in the state dict: b, n", str(cm.exception))

    def test_default_loads_a_subset_and_reports_the_rest(self):
        # A pipeline stage, or a model-only resume: the state dict asks for
        # part of what the checkpoint holds.
        layers = {"layers.0.w": filled((3, 3), torch.float32, 1),
                  "layers.1.w": filled((3, 3), torch.float32, 2)}
        ferry.save(layers, self.root, 2)
        z = torch.zeros(3, 3)
        res = ferry.load({"layers.0.w": z}, self.root)
        self.assertTrue(torch.equal(z, layers["layers.0.w"]))
        self.assertEqual(res.missing_keys, [])
        self.assertEqual(res.unexpected_keys, ["layers.1.w"])
        self.assertEqual(res.step, 2)

    def test_default_names_a_missing_key(self):
        target = {"a": torch.zeros(4), "c": torch.zeros(1)}
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.load(target, self.root)
        msg = str(cm.exception)
        self.assertIn("missing from the checkpoint: c", msg)
        self.assertIn("strict=False", msg)  # says how to load the rest
        self.assertNotIn("not in the state dict", msg)  # b and n are not an error
        self.assertEqual(cm.exception.code, "invalid_argument")
        self.assertTrue(torch.equal(target["a"], torch.zeros(4)))  # nothing loaded

    def test_non_strict_returns_lists(self):
        target = {"a": torch.zeros(4), "c": torch.zeros(1)}
        res = ferry.load(target, self.root, strict=False)
        self.assertEqual(res.missing_keys, ["c"])
        self.assertEqual(res.unexpected_keys, ["b", "n"])
        self.assertTrue(torch.equal(target["a"], self.sd["a"]))
        self.assertTrue(torch.equal(target["c"], torch.zeros(1)))

    def test_dtype_mismatch_and_cast(self):
        target = {"a": torch.zeros(4, dtype=torch.float16), "b": torch.zeros(2, 2), "n": 0}
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.load(target, self.root)
        self.assertIn("'a' is torch.float16 here, torch.float32 in the checkpoint", str(cm.exception))
        self.assertIn("cast=True", str(cm.exception))
        ferry.load(target, self.root, cast=True)
        self.assertTrue(torch.equal(target["a"], self.sd["a"].half()))
        self.assertTrue(torch.equal(target["b"], self.sd["b"].float()))

    def test_key_map(self):
        target = {"alpha": torch.zeros(4), "beta": torch.zeros(2, 2, dtype=torch.float64), "n": 0}
        ferry.load(target, self.root, key_map={"alpha": "a", "beta": "b"})
        self.assertTrue(torch.equal(target["alpha"], self.sd["a"]))
        self.assertTrue(torch.equal(target["beta"], self.sd["b"]))
        self.assertEqual(target["n"], 3)
        t2 = {"x.a": torch.zeros(4), "x.b": torch.zeros(2, 2, dtype=torch.float64), "x.n": 0}
        ferry.load(t2, self.root, key_map=lambda k: k[2:])
        self.assertTrue(torch.equal(t2["x.a"], self.sd["a"]))


class StrictObjects(Base):
    """strict=False holds for modules and optimizers as for plain dicts."""

    def model(self, sizes, seed):
        torch.manual_seed(seed)
        layers = []
        for a, b in zip(sizes, sizes[1:]):
            layers.append(torch.nn.Linear(a, b))
        return torch.nn.Sequential(*layers)

    def test_module_with_an_extra_and_a_missing_layer(self):
        saved = self.model([4, 4, 4], 0)  # layers 0 and 1
        ferry.save({"model": saved}, self.root, 1)
        # Layer 0 as saved, layer 1 of another shape is not there (a
        # different key), layer 2 is new: "1" and "2" differ by key.
        target = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Identity(),
                                     torch.nn.Linear(4, 4))
        fresh = target[2].weight.detach().clone()
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.load({"model": target}, self.root)
        self.assertIn("model.2.weight", str(cm.exception))
        res = ferry.load({"model": target}, self.root, strict=False)
        self.assertEqual(res.missing_keys, ["model.2.bias", "model.2.weight"])
        self.assertEqual(res.unexpected_keys, ["model.1.bias", "model.1.weight"])
        self.assertTrue(torch.equal(target[0].weight, saved[0].weight))
        self.assertTrue(torch.equal(target[0].bias, saved[0].bias))
        self.assertTrue(torch.equal(target[2].weight, fresh))  # left alone

    def test_module_subset_by_default(self):
        saved = self.model([4, 4, 4], 0)
        ferry.save({"model": saved}, self.root, 1)
        target = torch.nn.Sequential(torch.nn.Linear(4, 4))  # stage 0 of a pipeline
        res = ferry.load({"model": target}, self.root)
        self.assertEqual(res.unexpected_keys, ["model.1.bias", "model.1.weight"])
        self.assertTrue(torch.equal(target[0].weight, saved[0].weight))

    def test_optimizer_missing_from_a_model_only_checkpoint(self):
        saved = self.model([4, 4], 0)
        ferry.save({"model": saved}, self.root, 1)
        target = self.model([4, 4], 5)
        opt = torch.optim.SGD(target.parameters(), lr=0.5)
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.load({"model": target, "optim": opt}, self.root)
        self.assertIn("optim.param_groups", str(cm.exception))
        res = ferry.load({"model": target, "optim": opt}, self.root, strict=False)
        self.assertTrue(any(k.startswith("optim.") for k in res.missing_keys), res.missing_keys)
        self.assertEqual(res.unexpected_keys, [])
        self.assertTrue(torch.equal(target[0].weight, saved[0].weight))
        self.assertEqual(opt.param_groups[0]["lr"], 0.5)  # left as it was


class ResolvedOnce(Base):
    """Tensors, leaves and key checks of one load come from one checkpoint,
    even when another commits between the manifest's read and the load."""

    def test_a_commit_during_the_load_does_not_mix_steps(self):
        ferry.save({"w": torch.full((4,), 1.0), "epoch": 1}, self.root, 1)
        real = ferry._core.Manifest
        root = self.root

        class CommitAfterRead(real):
            def __init__(self, path, *runtime):
                super().__init__(path, *runtime)
                if not os.path.isdir(os.path.join(root, "step-00000002")):
                    ferry.save({"w": torch.full((4,), 2.0), "epoch": 2, "extra": 5}, root, 2)

        ferry._core.Manifest = CommitAfterRead
        try:
            target = {"w": torch.zeros(4), "epoch": 0}
            res = ferry.load(target, self.root, strict=True)
        finally:
            ferry._core.Manifest = real
        self.assertTrue(os.path.isdir(os.path.join(self.root, "step-00000002")))
        self.assertEqual(target["epoch"], 1)
        self.assertTrue(torch.equal(target["w"], torch.full((4,), 1.0)))
        self.assertEqual(res.step, 1)
        self.assertEqual(res.stats["step"], 1)
        self.assertTrue(res.path.endswith("step-00000001"), res.path)
        # The next load of the root reads the new one.
        res = ferry.load(target, self.root)
        self.assertEqual((target["epoch"], res.step, res.unexpected_keys), (2, 2, ["extra"]))


class Errors(Base):
    def test_shape_mismatch_names_tensor(self):
        ferry.save({"w": torch.zeros(3, 3)}, self.root, 1)
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.load({"w": torch.zeros(4, 3)}, self.root)
        self.assertIn("'w'", str(cm.exception))
        self.assertIn("[4, 3]", str(cm.exception))
        self.assertEqual(cm.exception.code, "invalid_argument")

    def test_no_checkpoint(self):
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.load({"w": torch.zeros(1)}, os.path.join(self.root, "nothing"))
        self.assertIn("nothing", str(cm.exception))

    def test_existing_step_fails_at_wait(self):
        ferry.save({"w": torch.zeros(1)}, self.root, 1)
        h = ferry.save_async({"w": torch.ones(1)}, self.root, 1)
        with self.assertRaises(ferry.FerryError) as cm:
            h.wait()
        self.assertIn("step-00000001", str(cm.exception))
        h = ferry.save_async({"w": torch.ones(1)}, self.root, 1, overwrite=True)
        h.wait()
        out = {"w": torch.zeros(1)}
        ferry.load(out, self.root)
        self.assertEqual(out["w"].item(), 1.0)

    def test_bad_values(self):
        # Neither a tensor, JSON, the typed encoding nor picklable.
        with self.assertRaises(TypeError) as cm:
            ferry.save_async({"x": lambda: 0}, self.root, 1)
        self.assertIn("'x'", str(cm.exception))
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.save_async({"c": torch.zeros(2, dtype=torch.complex64)}, self.root, 1)
        self.assertIn("'c'", str(cm.exception))
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.Runtime({"pool_bytes": "lots"}, rank=0, world_size=1)
        self.assertIn("pool-bytes", str(cm.exception))


class Shards(Base):
    def test_row_col_flat(self):
        full = filled((10, 6), torch.float32)
        flat = filled((17,), torch.int16)
        # Saved as three row shards by "three ranks" (three saves of one key
        # are not possible in one process, so each is its own checkpoint key).
        ferry.save({"full": full, "flat": flat}, self.root, 1)
        for world in (2, 3, 4):
            for r in range(world):
                rs = ferry.row_shard((10, 6), r, world)
                cs = ferry.col_shard((10, 6), r, world)
                a, b = ferry.split_range(17, r, world)
                fs = ferry.flat_shard(torch.zeros(b - a, dtype=torch.int16), 17, a)
                ferry.load({"full": rs}, self.root, strict=False)
                ferry.load({"full": cs}, self.root, strict=False)
                ferry.load({"flat": fs}, self.root, strict=False)
                s, e = ferry.split_range(10, r, world)
                self.assertTrue(torch.equal(rs.tensor, full[s:e]))
                s, e = ferry.split_range(6, r, world)
                self.assertTrue(torch.equal(cs.tensor, full[:, s:e]))
                self.assertTrue(torch.equal(fs.tensor, flat[a:b]))

    def test_saved_as_shard(self):
        full = filled((8, 4), torch.float32)
        # One rank alone holding half of a global tensor: the save is refused
        # at the plan, naming the key and the box nobody holds.
        h = ferry.save_async({"half": ferry.row_shard(full, 1, 2)}, self.root, 1)
        with self.assertRaises(ferry.FerryError) as cm:
            h.wait()
        self.assertIn("'half'", str(cm.exception))
        self.assertIn("[0:4, 0:4]", str(cm.exception))
        ferry.save({"part": ferry.Shard(full, (8, 4), (0, 0))}, self.root, 2)
        man = ferry.read_manifest(self.root)
        self.assertEqual(man.tensors["part"].shape, (8, 4))
        got = ferry.row_shard((8, 4), 1, 2)
        ferry.load({"part": got}, self.root)
        self.assertTrue(torch.equal(got.tensor, full[4:]))


class ManagerErrors(Base):
    def test_failed_save_is_raised_once(self):
        with ferry.CheckpointManager(self.root) as mgr:
            mgr.save(1, {"w": torch.zeros(1)})
        mgr2 = ferry.CheckpointManager(self.root)
        with self.assertRaises(ferry.FerryError) as cm:
            mgr2.save(1, {"w": torch.ones(1)})  # step 1 exists
            mgr2.wait_until_finished()
        self.assertIn("step-00000001", str(cm.exception))
        mgr2.wait_until_finished()  # reported already: not again
        self.assertEqual(mgr2.restore(step=1)["w"].item(), 0.0)


class ShardedTensorMapping(Base):
    """torch's ShardedTensor (1.13; also in 2.x) is saved and loaded as its
    local shard of the global tensor. One process, so one shard covers it."""

    @classmethod
    def setUpClass(cls):
        import ferry.torch_compat

        ferry.torch_compat.enable()  # torch 1.13's module on Python 3.11
        import torch.distributed as dist

        # The store's file goes with its folder at the end (gloo leaves it).
        cls.store_dir = tempfile.mkdtemp(prefix="ferry_py_store_")
        if not dist.is_initialized():
            store = dist.FileStore(os.path.join(cls.store_dir, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    @classmethod
    def tearDownClass(cls):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(cls.store_dir, ignore_errors=True)

    def sharded(self, t):
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard as TShard
        from torch.distributed._shard.sharded_tensor import init_from_local_shards

        md = ShardMetadata([0] * t.dim(), list(t.shape), "rank:0/cpu")
        return init_from_local_shards([TShard(t, md)], *t.shape)

    def test_round_trip_and_cross_load(self):
        w = filled((6, 4), torch.float32)
        ferry.save({"st": self.sharded(w.clone()), "plain": w}, self.root, 1)
        man = ferry.read_manifest(self.root)
        self.assertEqual(man.tensors["st"].shape, (6, 4))
        # A ShardedTensor target filled from a plain save, and the reverse.
        target_st = self.sharded(torch.zeros(6, 4))
        plain = torch.zeros(6, 4)
        ferry.load({"st": plain, "plain": target_st}, self.root)
        self.assertTrue(torch.equal(plain, w))
        self.assertTrue(torch.equal(target_st.local_shards()[0].tensor, w))


class Manager(Base):
    def test_interval_retention_restore(self):
        w = torch.zeros(3)
        with ferry.CheckpointManager(self.root, save_interval_steps=2, keep_last=2) as mgr:
            self.assertIsNone(mgr.latest_step())
            saved = []
            for step in range(1, 8):
                w.fill_(step)
                if mgr.save(step, {"w": w, "step": step}):
                    saved.append(step)
            self.assertEqual(saved, [2, 4, 6])
            self.assertFalse(mgr.should_save(6))
            self.assertTrue(mgr.should_save(8))
        self.assertEqual(mgr.all_steps(), [4, 6])
        self.assertEqual(mgr.latest_step(), 6)
        state = {"w": torch.zeros(3), "step": 0}
        mgr.restore(state=state)
        self.assertEqual(state["step"], 6)
        self.assertTrue(torch.equal(state["w"], torch.full((3,), 6.0)))
        old = mgr.restore(step=4)
        self.assertEqual(old["step"], 4)
        self.assertTrue(torch.equal(old["w"], torch.full((3,), 4.0)))
        with self.assertRaises(ferry.FerryError):
            ferry.CheckpointManager(os.path.join(self.root, "none")).restore()


    def test_retention_runs_beside_training(self):
        from ferry import manager as manager_mod

        real = manager_mod._core.apply_retention
        started, release = threading.Event(), threading.Event()
        calls = []

        def slow(root, keep_last):  # a deletion that takes as long as the test says
            calls.append(keep_last)
            started.set()
            if not release.wait(60):
                raise AssertionError("never released")
            real(root, keep_last)

        manager_mod._core.apply_retention = slow
        try:
            w = torch.zeros(3)
            mgr = ferry.CheckpointManager(self.root, keep_last=1)
            mgr.save(1, {"w": w})
            mgr.save(2, {"w": w})
            # Both commits known: the first starts a retention, which
            # hangs; the saves after it return all the same.
            mgr._finish_previous(block=True)
            self.assertTrue(started.wait(30))
            mgr.save(3, {"w": w})
            mgr.save(4, {"w": w})
            self.assertEqual(len(calls), 1)  # one at a time
            release.set()
            mgr.close()  # joins it, and retires what came meanwhile
            self.assertEqual(mgr.all_steps(), [4])
            self.assertGreaterEqual(len(calls), 2)
        finally:
            manager_mod._core.apply_retention = real

    def test_retention_error_reaches_the_caller(self):
        from ferry import manager as manager_mod

        real = manager_mod._core.apply_retention

        def broken(root, keep_last):
            raise ferry.FerryError("retention of %s failed (injected)" % root, "io_error")

        manager_mod._core.apply_retention = broken
        try:
            mgr = ferry.CheckpointManager(self.root, keep_last=1)
            mgr.save(1, {"w": torch.zeros(2)})
            with self.assertRaises(ferry.FerryError) as e:
                mgr.close()
            self.assertIn("(injected)", str(e.exception))
        finally:
            manager_mod._core.apply_retention = real


class Lifecycle(Base):
    def test_exit_waits_for_inflight_save(self):
        # The interpreter exits right after save_async: atexit waits for the
        # commit instead of leaving a pending directory behind.
        code = (
            "import torch, ferry, sys\n"
            "ferry.configure(pool_bytes='16MiB')\n"
            "h = ferry.save_async({'w': torch.arange(1 << 20, dtype=torch.float32)}, sys.argv[1], 5)\n"
            "del h\n"
        )
        import subprocess

        p = subprocess.run([sys.executable, "-c", code, self.root], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stdout)
        self.assertEqual(ferry.list_steps(self.root), [5])
        self.assertEqual([n for n in os.listdir(self.root) if n.startswith(".pending")], [])
        out = {"w": torch.zeros(1 << 20)}
        ferry.load(out, self.root)
        self.assertTrue(torch.equal(out["w"], torch.arange(1 << 20, dtype=torch.float32)))


class Fork(Base):
    def test_forked_child_does_not_break_parent(self):
        ferry.save({"w": torch.ones(2)}, self.root, 1)
        parent_rt = ferry.default_runtime()
        pid = os.fork()
        if pid == 0:
            # A DataLoader worker: it must neither use nor tear down the
            # parent's runtime (os._exit skips atexit, as multiprocessing does).
            code = 4
            try:
                ferry.save({"w": torch.ones(2)}, self.root, 9, runtime=parent_rt)
            except ferry.FerryError as e:
                code = 0 if "forked child" in str(e) else 5
            if ferry._core._default is not None:
                code = 6
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(os.WEXITSTATUS(status), 0)
        ferry.save({"w": torch.full((2,), 2.0)}, self.root, 2)
        out = {"w": torch.zeros(2)}
        ferry.load(out, self.root)
        self.assertEqual(out["w"].tolist(), [2.0, 2.0])


class Logging(Base):
    def test_warnings_reach_the_ferry_logger(self):
        # A load that leaves checkpoint tensors out says so, through logging.
        rt = ferry.Runtime({"pool_bytes": "8MiB", "chunk_bytes": "1MiB"}, rank=0, world_size=1)
        try:
            sd = {"model": {"w": torch.ones(4)}, "optim": {"m": torch.full((3,), 2.0)}}
            ferry.save(sd, self.root, 1, runtime=rt)
            with self.assertLogs("ferry", level="WARNING") as logs:
                fresh = ferry.load_state_dict(self.root, runtime=rt, prefix="optim")
            self.assertEqual(fresh["m"].tolist(), [2.0, 2.0, 2.0])
            self.assertEqual(len(logs.records), 1)
            self.assertEqual(logs.records[0].levelno, logging.WARNING)
            self.assertIn("1 checkpoint tensors not restored: model.w",
                          logs.records[0].getMessage())
        finally:
            rt.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
