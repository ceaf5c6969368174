"""Every Python value a training script holds comes back with its type:
tuples (AdamW's betas), ints vs floats, None, bools, bytes, sets, dicts with
int keys, nested containers; what only pickle can hold (OneCycleLR's
anneal_func) is loaded only with allow_pickle=True; an empty dict takes
whatever the checkpoint holds under its key, strict load included; a
checkpoint written with JSON leaves only (the format before typed values)
still loads.

Run by ctest (exit 77 = skipped when torch is not importable)."""

import fractions
import json
import shutil
import tempfile
import unittest

import _support  # noqa: F401 (exits 77, skipped, without torch)
import torch  # noqa: E402

import ferry
from ferry import _tree

ferry.configure(pool_bytes="32MiB", chunk_bytes="1MiB")


def model_and_adamw(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    return m, opt


def train_step(m, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 4, generator=g)
    loss = m(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


class Base(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="ferry_values_")

    def tearDown(self):
        shutil.rmtree(self.root, ignore_errors=True)


class Types(Base):
    def test_adamw_betas_stay_a_tuple(self):
        m, opt = model_and_adamw(0)
        train_step(m, opt, 1)
        ferry.save({"model": m, "optim": opt}, self.root, 1)
        m2, opt2 = model_and_adamw(5)
        opt2.param_groups[0]["betas"] = (0.1, 0.2)
        ferry.load({"model": m2, "optim": opt2}, self.root)
        betas = opt2.param_groups[0]["betas"]
        self.assertIs(type(betas), tuple)
        self.assertEqual(betas, (0.8, 0.95))
        # The resumed optimizer steps exactly as the original.
        self.assertEqual(train_step(m, opt, 2), train_step(m2, opt2, 2))
        for a, b in zip(m.parameters(), m2.parameters()):
            self.assertTrue(torch.equal(a, b))

    def test_types_kept(self):
        values = {
            "pair": (1, 2.0),
            "ints_floats": [1, 1.0, -0.0, float("inf")],
            "none": None,
            "flag": False,
            "nested": [(1, [None, (True, "x")]), {"a": (3,)}],
            "int_keys": [{1: "one", 2: (2.5,)}],
            "raw": b"\x00\xffbytes",
            "a_set": {3, 1, 2},
            "frozen": frozenset({"a"}),
            "empty_tuple": (),
        }
        ferry.save(dict(values, w=torch.ones(1)), self.root, 1)
        target = {k: None for k in values}
        target["w"] = torch.zeros(1)
        ferry.load(target, self.root, strict=True)
        fresh = ferry.load_state_dict(self.root)
        for got in (target, fresh):
            self.assertTrue(torch.equal(got["w"], torch.ones(1)))
            for k, v in values.items():
                self.assertEqual(got[k], v, k)
                self.assertEqual(repr(got[k]), repr(v), k)  # types, nested ones included
        # Values JSON holds as they are stay in the JSON leaves (read by
        # older readers and by `ferry export`); the others are typed.
        man = ferry.read_manifest(self.root)
        plain = json.loads(man.metadata[_tree.LEAVES_META_KEY])
        self.assertEqual(plain, {"none": None, "flag": False, "ints_floats": [1, 1.0, -0.0, float("inf")]})
        self.assertNotIn(_tree.PICKLED_META_KEY, man.metadata)
        self.assertEqual(man.pickled, set())

    def test_tuple_holding_tensors_and_values(self):
        t = torch.arange(6.0)
        ferry.save({"x": (t, (1, 2), 3.0)}, self.root, 1)
        fresh = ferry.load_state_dict(self.root)
        self.assertEqual(fresh["x"][1], (1, 2))
        self.assertIs(type(fresh["x"][1]), tuple)
        self.assertIs(type(fresh["x"][2]), float)


class Pickle(Base):
    def one_cycle(self, seed):
        m, opt = model_and_adamw(seed)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
        return m, opt, sched

    def test_one_cycle_lr_round_trip(self):
        m, opt, sched = self.one_cycle(0)
        for i in range(3):
            train_step(m, opt, i)
            sched.step()
        ferry.save({"model": m, "optim": opt, "sched": sched}, self.root, 1)
        man = ferry.read_manifest(self.root)
        self.assertIn("sched.anneal_func", man.pickled)
        self.assertEqual(json.loads(man.metadata[_tree.PICKLED_META_KEY]), ["sched.anneal_func"])
        self.assertIsInstance(man.leaves["sched.anneal_func"], _tree.Pickled)
        # The scheduler is a reference in the pickle, not a copy of it, its
        # optimizer and their tensors.
        self.assertLess(len(man.leaves["sched.anneal_func"].data), 200)

        m2, opt2, sched2 = self.one_cycle(7)
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.load({"model": m2, "optim": opt2, "sched": sched2}, self.root)
        msg = str(cm.exception)
        self.assertIn("'sched.anneal_func'", msg)
        self.assertIn("allow_pickle=True", msg)
        # Refused before anything was loaded.
        self.assertEqual(sched2.last_epoch, 0)
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.load_state_dict(self.root)
        self.assertIn("allow_pickle=True", str(cm.exception))

        ferry.load({"model": m2, "optim": opt2, "sched": sched2}, self.root, allow_pickle=True)
        self.assertEqual(sched2.last_epoch, sched.last_epoch)
        self.assertEqual(sched2.anneal_func.__self__, sched2)
        self.assertEqual(sched2.anneal_func.__name__, sched.anneal_func.__name__)
        for _ in range(5):
            self.assertEqual(train_step(m, opt, 9), train_step(m2, opt2, 9))
            sched.step()
            sched2.step()
            self.assertEqual(sched.get_last_lr(), sched2.get_last_lr())

    def test_other_object_needs_allow_pickle(self):
        ferry.save({"w": torch.ones(2), "ratio": fractions.Fraction(1, 3)}, self.root, 1)
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.load({"w": torch.zeros(2), "ratio": None}, self.root)
        self.assertIn("'ratio' (fractions.Fraction)", str(cm.exception))
        target = {"w": torch.zeros(2), "ratio": None}
        ferry.load(target, self.root, allow_pickle=True)
        self.assertEqual(target["ratio"], fractions.Fraction(1, 3))
        # A load that does not ask for the pickled value needs no permission.
        only_w = {"w": torch.zeros(2)}
        ferry.load(only_w, self.root)
        self.assertTrue(torch.equal(only_w["w"], torch.ones(2)))

    def test_unpicklable_refused_at_save(self):
        with self.assertRaises(TypeError) as cm:
            ferry.save({"w": torch.ones(2), "fn": lambda x: x}, self.root, 1)
        self.assertIn("'fn'", str(cm.exception))


class Placeholder(Base):
    def test_empty_dict_takes_the_subtree_strict(self):
        m, opt = model_and_adamw(0)
        train_step(m, opt, 1)
        ferry.save({"model": m, "optim": opt, "epoch": 3}, self.root, 1)
        optim_sd = {}
        target = {"model": model_and_adamw(4)[0], "optim": optim_sd, "epoch": 0}
        res = ferry.load(target, self.root, strict=True)
        self.assertEqual((res.missing_keys, res.unexpected_keys), ([], []))
        self.assertIs(target["optim"], optim_sd)  # filled in place
        want = opt.state_dict()
        self.assertEqual(optim_sd["param_groups"], want["param_groups"])
        self.assertIs(type(optim_sd["param_groups"][0]["betas"]), tuple)
        self.assertEqual(sorted(optim_sd["state"]), sorted(want["state"]))
        for i, st in want["state"].items():
            for name, v in st.items():
                self.assertTrue(torch.equal(optim_sd["state"][i][name], v), (i, name))
        # It loads into a fresh optimizer as torch's own state dict would.
        m3, opt3 = model_and_adamw(4)
        opt3.load_state_dict(optim_sd)

    def test_empty_dict_saved_comes_back_empty(self):
        target = {"w": torch.zeros(1), "extra": None, "more": {}}
        ferry.save({"w": torch.ones(1), "extra": {}, "more": {}}, self.root, 2)
        ferry.load(target, self.root, strict=True)
        self.assertEqual((target["extra"], target["more"]), ({}, {}))

    def test_empty_dict_with_nothing_under_it_is_missing(self):
        ferry.save({"w": torch.ones(1)}, self.root, 1)
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.load({"w": torch.zeros(1), "optim": {}}, self.root, strict=True)
        self.assertIn("optim", str(cm.exception))


class OldFormat(Base):
    def test_json_only_leaves_still_load(self):
        # The writer before typed values: every leaf as JSON in one key.
        def old_encode(flat):
            return [(_tree.TREE_META_KEY, json.dumps(flat.paths)),
                    (_tree.LEAVES_META_KEY, json.dumps(flat.leaves))]

        saved = _tree.encode_meta
        _tree.encode_meta = old_encode
        try:
            ferry.save({"w": torch.ones(2), "betas": (0.9, 0.99), "cfg": {"lr": 0.5}, "n": 3},
                       self.root, 1)
        finally:
            _tree.encode_meta = saved
        man = ferry.read_manifest(self.root)
        self.assertNotIn(_tree.VALUES_META_KEY, man.metadata)
        target = {"w": torch.zeros(2), "betas": None, "cfg": {"lr": 0.0}, "n": 0}
        ferry.load(target, self.root, strict=True)
        self.assertEqual(target["betas"], [0.9, 0.99])  # what that format kept
        self.assertEqual(target["cfg"], {"lr": 0.5})
        self.assertEqual(target["n"], 3)
        self.assertTrue(torch.equal(target["w"], torch.ones(2)))


class Corrupt(Base):
    def test_bad_value_encoding_names_the_key(self):
        values = {"k": {"tuple": 5}}
        with self.assertRaises(ferry.FerryError) as cm:
            _tree.decode_values({_tree.VALUES_META_KEY: json.dumps(values)})
        self.assertIn("'k'", str(cm.exception))
        self.assertEqual(cm.exception.code, "corruption")


if __name__ == "__main__":
    unittest.main(verbosity=2)
