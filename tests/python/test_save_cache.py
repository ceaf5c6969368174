"""A repeated save_async of a state dict of the same shape reuses the last
save's walk and prepared C state dict (ferry/_save_cache.py), updating only
what changed: each kind of change between two saves (tensor replaced,
resized, a new key, a removed key, a plain or typed value changed, an
optimizer step, bytes changed in place) loads back exactly what each save
saw; the mutation check and its message still hold on a cached save.

Run by ctest (exit 77 = skipped when torch is not importable)."""

import os
import shutil
import tempfile
import unittest
import weakref

import _support  # noqa: F401 (exits 77, skipped, without torch)
import torch  # noqa: E402

import ferry
from ferry import _pack, _save_cache


def state(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    return {"w%d" % i: torch.randn(4, 3, generator=g) for i in range(n)}


def clone(tree):
    if isinstance(tree, dict):
        return {k: clone(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    return tree


def zeros_like(tree):
    if isinstance(tree, dict):
        return {k: zeros_like(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return None


class Base(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="ferry_save_cache_")
        self.rt = ferry.Runtime({"pool_bytes": "8MiB"}, rank=0, world_size=1)

    def tearDown(self):
        self.rt.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def save(self, tree, step):
        return self.rt.save_async(tree, self.root, step).wait()

    def assert_loads(self, path, expected):
        """The checkpoint at `path` holds exactly `expected` (same keys)."""
        target = zeros_like(expected)
        self.rt.load(target, path, strict=True)
        self.assert_same(target, expected)

    def assert_same(self, got, expected, where=""):
        if isinstance(expected, dict):
            self.assertEqual(sorted(got), sorted(expected), where)
            for k in expected:
                self.assert_same(got[k], expected[k], where + "." + k)
        elif isinstance(expected, torch.Tensor):
            self.assertEqual(got.shape, expected.shape, where)
            self.assertTrue(torch.equal(got, expected), where)
        else:
            self.assertEqual(type(got), type(expected), where)
            self.assertEqual(got, expected, where)


class Changes(Base):
    def two_saves(self, first, second, cached=False):
        """Saves `first` then `second` (copies taken at save time) and checks
        each step loads back as it was saved; `cached`: the second save is
        one the cache answers (only its changed entries replaced)."""
        a = clone(first)
        p1 = self.save(first, 1)
        b = clone(second)
        hits = self.rt._save_cache.hits
        p2 = self.save(second, 2)
        self.assertEqual(self.rt._save_cache.hits, hits + (1 if cached else 0))
        self.assert_loads(p1, a)
        self.assert_loads(p2, b)

    def test_unchanged_shape_is_served_from_the_cache(self):
        sd = state(0)
        self.save(sd, 1)
        hits = self.rt._save_cache.hits
        sd["w2"].add_(1.0)  # the same tensors, new bytes
        expected = clone(sd)
        p = self.save(sd, 2)
        self.assertEqual(self.rt._save_cache.hits, hits + 1)
        self.assert_loads(p, expected)
        # A new dict object with the same keys and tensors is the same shape.
        p = self.save(dict(sd), 3)
        self.assertEqual(self.rt._save_cache.hits, hits + 2)
        self.assert_loads(p, expected)

    def test_tensor_replaced(self):
        sd = state(1)
        second = dict(sd)
        second["w3"] = torch.full((4, 3), 7.0)
        self.two_saves(sd, second, cached=True)

    def test_tensor_resized(self):
        sd = state(2)
        second = dict(sd)
        second["w0"] = torch.arange(20.0).reshape(5, 4)
        self.two_saves(sd, second, cached=True)

    def test_dtype_changed(self):
        sd = state(3)
        second = dict(sd)
        second["w1"] = sd["w1"].to(torch.float64)
        self.two_saves(sd, second, cached=True)

    def test_first_save_dtype_columns(self):
        # _pack._dtype_codes answers a state of one dtype with one lookup:
        # mixed dtypes still get each its own code, and an unsupported one
        # among supported ones (or alone in a uniform state) is refused
        # naming its key.
        mixed = state(5)
        mixed["w1"] = mixed["w1"].to(torch.float64)
        mixed["w4"] = (mixed["w4"] * 100).to(torch.int16)
        expected = clone(mixed)
        p = self.save(mixed, 1)
        man = ferry.read_manifest(p)
        self.assertEqual({k: man.torch_dtype(k) for k in expected},
                         {k: t.dtype for k, t in expected.items()})
        self.assert_loads(p, expected)
        odd = state(6)
        odd["w3"] = torch.zeros(4, 3, dtype=torch.complex64)
        with self.assertRaises(ferry.FerryError) as cm:
            self.save(odd, 2)
        self.assertIn("'w3'", str(cm.exception))
        uniform = {k: torch.zeros(2, dtype=torch.complex64) for k in ("c0", "c1")}
        with self.assertRaises(ferry.FerryError) as cm:
            self.save(uniform, 3)
        self.assertIn("'c0'", str(cm.exception))

    def test_same_tensor_changed_in_place_between_saves(self):
        # Each change keeps the tensor object and its version (or changes
        # only what a version bump says nothing about): the cache must still
        # see the new shape, dtype, address or layout, else the second save
        # holds the first's shape or reads memory the tensor left.
        def resize_same_numel(sd):
            sd["w0"].resize_(3, 4).copy_(torch.arange(12.0).reshape(3, 4))

        def resize_bigger(sd):
            sd["w1"].resize_(40, 30).fill_(5.0)

        def storage_resize(sd):
            t = sd["w2"]
            t.storage().resize_(1 << 16)  # moved: the shape stays, the address does not
            t.fill_(3.0)

        def data_of_other_dtype(sd):
            t = sd["w3"]
            t.data = t.view(torch.int32)  # the same memory, read as int32

        def data_of_other_memory(sd):
            sd["w4"].data = torch.full((4, 3), 9.0)

        def transposed(sd):
            sd["w5"].resize_(3, 3).copy_(torch.arange(9.0).reshape(3, 3))

        def transposed_again(sd):
            sd["w5"].t_()  # same shape and address, no longer contiguous

        for i, change in enumerate((resize_same_numel, resize_bigger, storage_resize,
                                    data_of_other_dtype, data_of_other_memory, transposed,
                                    transposed_again)):
            sd = state(20 + i)
            if change is transposed_again:
                transposed(sd)
            tree = {"run%d" % i: sd}  # keys of its own: the first save is not a cached one
            a = clone(tree)
            p1 = self.save(tree, 2 * i + 1)
            versions = {k: t._version for k, t in sd.items()}
            hits = self.rt._save_cache.hits
            change(sd)
            if change in (data_of_other_dtype, data_of_other_memory):
                self.assertEqual(versions, {k: t._version for k, t in sd.items()})
            b = {"run%d" % i: {k: t.clone(memory_format=torch.contiguous_format)
                               for k, t in sd.items()}}
            p2 = self.save(tree, 2 * i + 2)
            with self.subTest(change=change.__name__):
                # Only a non-contiguous tensor takes the full walk.
                self.assertEqual(self.rt._save_cache.hits,
                                 hits + (0 if change is transposed_again else 1))
                self.assert_loads(p1, a)
                self.assert_loads(p2, b)

    def test_new_key(self):
        sd = state(4)
        second = dict(sd)
        second["extra"] = torch.ones(2)
        self.two_saves(sd, second)

    def test_removed_key(self):
        sd = state(5)
        second = dict(sd)
        del second["w4"]
        self.two_saves(sd, second)

    def test_plain_value_changed(self):
        sd = {"model": state(6), "step": 10, "name": "run"}
        second = {"model": sd["model"], "step": 11, "name": "run"}
        self.two_saves(sd, second)
        # An int that became a float of the same value is a change too.
        third = {"model": sd["model"], "step": 11.0, "name": "run"}
        p = self.save(third, 3)
        self.assert_loads(p, clone(third))

    def test_typed_value_changed(self):
        sd = {"model": state(7), "betas": (0.9, 0.99)}
        second = {"model": sd["model"], "betas": (0.8, 0.95)}
        self.two_saves(sd, second)

    def test_many_tensors_changed(self):
        sd = state(8, n=12)
        second = {k: v + 1 for k, v in sd.items()}  # every tensor new
        self.two_saves(sd, second)

    def test_optimizer_step(self):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3)
        opt = torch.optim.Adam(m.parameters(), lr=0.1)

        def step():
            opt.zero_grad()
            m(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()

        step()
        p1 = self.save({"model": m, "optim": opt}, 1)
        first = {"model": clone(m.state_dict()), "optim": clone(opt.state_dict()["state"])}
        step()
        p2 = self.save({"model": m, "optim": opt}, 2)
        second = {"model": clone(m.state_dict()), "optim": clone(opt.state_dict()["state"])}
        for path, want in ((p1, first), (p2, second)):
            m2 = torch.nn.Linear(4, 3)
            opt2 = torch.optim.Adam(m2.parameters(), lr=0.1)
            ferry.load({"model": m2, "optim": opt2}, path, runtime=self.rt)
            self.assert_same(clone(m2.state_dict()), want["model"])
            got = opt2.state_dict()["state"]
            self.assertEqual(len(got), len(want["optim"]))
            for i, s in want["optim"].items():
                for field, v in s.items():
                    self.assertTrue(torch.equal(got[i][field], v), "%s.%s" % (i, field))

    def test_per_rank_entries_stay_per_rank_on_repeated_saves(self):
        # "rng" is per-rank by name: a new RNG state each save must still be
        # stored as this rank's own copy, not as a plain (replicated) key.
        for step in (1, 2, 3):
            torch.manual_seed(step)
            sd = {"w": torch.ones(3), "rng": torch.get_rng_state()}
            expected = sd["rng"].clone()
            p = self.save(sd, step)
            keys = set(ferry.read_manifest(p).tensors)
            self.assertIn("rng@rank0", keys, "step %d" % step)
            self.assertNotIn("rng", keys, "step %d" % step)
            target = {"w": torch.zeros(3), "rng": torch.zeros_like(expected)}
            self.rt.load(target, p, strict=True)
            self.assertTrue(torch.equal(target["rng"], expected), "step %d" % step)


def slow_runtime():
    """A snapshot that streams for seconds after save_async returns: a 2 MiB
    pool and every write slowed by the fault injector."""
    old = os.environ.get("FERRY_FAULTS")
    os.environ["FERRY_FAULTS"] = "latency:write:30ms"
    try:
        return ferry.Runtime({"pool_bytes": "2MiB", "chunk_bytes": "1MiB", "direct_io": False},
                             rank=0, world_size=1)
    finally:
        if old is None:
            del os.environ["FERRY_FAULTS"]
        else:
            os.environ["FERRY_FAULTS"] = old


class BuiltApart(Base):
    """From _save_cache._APART_TENSORS tensors a first save's C state dict is
    built on a thread of its own beside the tree's JSON: what it built is
    saved, and its error reaches the caller with C's message (read on the
    thread that made the call)."""

    def many(self, seed):
        n = _save_cache._APART_TENSORS + 10
        g = torch.Generator().manual_seed(seed)
        return {"layer%05d.w" % i: torch.randn(2, generator=g) for i in range(n)}

    def test_built_apart_is_saved_whole(self):
        sd = self.many(0)
        expected = clone(sd)
        self.assert_loads(self.save(sd, 1), expected)
        hits = self.rt._save_cache.hits
        self.assert_loads(self.save(sd, 2), expected)
        self.assertEqual(self.rt._save_cache.hits, hits + 1)

    def test_error_of_the_build_apart_is_raised_with_its_message(self):
        sd = self.many(1)
        n = len(sd)
        columns = _pack.columns

        def cut_last_key(*args, **kwargs):
            req, keep = columns(*args, **kwargs)
            req.keys_bytes -= 3  # the last key loses its NUL
            return req, keep

        _pack.columns = cut_last_key
        try:
            with self.assertRaises(ferry.FerryError) as cm:
                self.rt.save_async(sd, self.root, 1)
        finally:
            _pack.columns = columns
        self.assertIn("holds %d keys, not %d" % (n - 1, n), str(cm.exception))
        self.assertIsNone(self.rt._save_cache._sd)
        expected = clone(sd)
        self.assert_loads(self.save(sd, 2), expected)


class NewStateOfTheSameKeys(Base):
    """A new state dict of the same keys (a model reloaded): _reuse sees
    from a few tensors that most moved and leaves it to _first at once,
    without reading every tensor first; a state with a few tensors moved is
    still served from the cache."""

    def test_reloaded_state_is_read_once(self):
        n = 16 * _save_cache._PROBES
        g = torch.Generator().manual_seed(3)
        first = {"p%04d" % i: torch.randn(3, generator=g) for i in range(n)}
        self.save(first, 1)
        reloaded = clone(first)
        for t in reloaded.values():
            t.add_(1.0)
        reads = []
        version = _save_cache._version
        _save_cache._version = lambda t: reads.append(1) or version(t)
        try:
            hits = self.rt._save_cache.hits
            p = self.save(reloaded, 2)
        finally:
            _save_cache._version = version
        self.assertEqual(self.rt._save_cache.hits, hits)
        self.assertEqual(len(reads), n)  # _first's pass alone
        self.assert_loads(p, reloaded)
        # A few tensors replaced: still the cache's.
        again = dict(reloaded)
        for k in list(again)[::100]:
            again[k] = torch.zeros(3)
        expected = clone(again)
        p = self.save(again, 3)
        self.assertEqual(self.rt._save_cache.hits, hits + 1)
        self.assert_loads(p, expected)


class StoragesHeld(Base):
    """A cached save holds, until its snapshot is done, storages that own
    every saved tensor's bytes: the last save's where a tensor kept its
    address, shape and dtype, fresh ones for the others and for each held
    storage that moved. The caller may drop its tensors (or t.set_() them)
    right after save_async."""

    def assert_held(self, h, tensors):
        held = h._storages
        self.assertEqual(len(held), len(tensors))
        for i, (s, t) in enumerate(zip(held, tensors)):
            start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            self.assertTrue(s.data_ptr() <= start and end <= s.data_ptr() + s.nbytes(),
                            "tensor %d [%#x, %#x) lies outside its held storage [%#x, +%d)"
                            % (i, start, end, s.data_ptr(), s.nbytes()))

    def test_each_change_between_saves_is_held(self):
        # Each change takes the state dict and the prefix of its keys.
        def set_other(sd, p):
            sd[p + "w0"].set_(torch.full((4, 3), 2.0))

        def data_other(sd, p):
            sd[p + "w1"].data = torch.full((4, 3), 3.0)

        def resize_bigger(sd, p):
            sd[p + "w2"].resize_(50, 40).fill_(4.0)

        def storage_moved(sd, p):
            sd[p + "w3"].storage().resize_(1 << 12)

        def shared(sd, p):
            sd[p + "w4"].share_memory_()

        def unsqueezed(sd, p):
            sd[p + "w5"].unsqueeze_(0)

        def replaced(sd, p):
            sd[p + "w0"] = torch.full((4, 3), 6.0)

        def same_storage_other_view(sd, p):
            t = sd[p + "w1"]
            t.set_(t.storage(), 6, (2, 3))

        for n, change in enumerate((set_other, data_other, resize_bigger, storage_moved, shared,
                                    unsqueezed, replaced, same_storage_other_view)):
            with self.subTest(change=change.__name__):
                prefix = "c%d." % n  # keys of its own: the first save is not a cached one
                sd = {prefix + k: t for k, t in state(40 + n).items()}
                self.save(sd, 3 * n + 1)
                hits = self.rt._save_cache.hits
                change(sd, prefix)
                expected = clone(sd)
                h = self.rt.save_async(sd, self.root, 3 * n + 2)
                self.assertEqual(self.rt._save_cache.hits, hits + 1)
                self.assert_held(h, list(sd.values()))
                p = h.wait()
                self.assert_loads(p, expected)
                # Unchanged since: the same storages serve the next save.
                h = self.rt.save_async(sd, self.root, 3 * n + 3)
                self.assertEqual(self.rt._save_cache.hits, hits + 2)
                self.assert_held(h, list(sd.values()))
                h.wait()

    def test_every_change_at_once_is_held(self):
        # The cache reads every column in one pass and sorts the entries out
        # afterwards: changes of each kind in one save, two of them on one
        # entry, must each be found.
        sd = state(60, n=48)  # eight changes in 48: still a cached save
        self.save(sd, 1)
        sd["w0"].set_(torch.full((4, 3), 2.0))
        sd["w1"].data = torch.full((4, 3), 3.0)
        sd["w2"].resize_(50, 40).fill_(4.0)
        sd["w3"].storage().resize_(1 << 12)
        sd["w4"].share_memory_()
        sd["w5"].unsqueeze_(0)
        sd["w6"] = torch.full((4, 3), 6.0)
        sd["w7"].storage().resize_(1 << 12)  # moved, then another shape on the same entry
        sd["w7"].resize_(2, 6)
        sd["w8"].data = sd["w8"].view(torch.int32)  # another dtype only
        expected = clone(sd)
        hits = self.rt._save_cache.hits
        h = self.rt.save_async(sd, self.root, 2)
        self.assertEqual(self.rt._save_cache.hits, hits + 1)
        self.assert_held(h, list(sd.values()))
        self.assert_loads(h.wait(), expected)
        # The next save finds nothing changed.
        h = self.rt.save_async(sd, self.root, 3)
        self.assertEqual(self.rt._save_cache.hits, hits + 2)
        self.assert_held(h, list(sd.values()))
        self.assert_loads(h.wait(), expected)

    def test_longer_tensor_at_the_same_address(self):
        # Two storages over one NumPy array: the second, longer, starts where
        # the first did. Only the shape says the held storage is too short.
        np = __import__("numpy")
        arr = np.arange(24, dtype=np.float32)
        sd = {"a": torch.from_numpy(arr[:12])}
        sd.update(state(9))  # one change in seven: a cached save
        self.save(sd, 1)
        sd["a"] = torch.from_numpy(arr)
        hits = self.rt._save_cache.hits
        h = self.rt.save_async(sd, self.root, 2)
        self.assertEqual(self.rt._save_cache.hits, hits + 1)
        self.assert_held(h, list(sd.values()))
        self.assert_loads(h.wait(), clone(sd))

    def test_caller_frees_its_tensors_after_a_cached_save_async(self):
        rt = slow_runtime()
        try:
            sd = {"w%d" % i: torch.full((1 << 20,), float(i)) for i in range(6)}
            rt.save_async(sd, self.root, 1).wait()
            sd["w1"] = torch.full((1 << 20,), 11.0)  # one changed, five as before
            expected = clone(sd)
            hits = rt._save_cache.hits
            h = rt.save_async(sd, self.root, 2)
            self.assertEqual(rt._save_cache.hits, hits + 1)
            self.assertFalse(h.snapshot_done())
            for t in sd.values():
                t.set_()  # the tensor lets its storage go
            del sd
            # Memory freed now would be reused by these.
            junk = [torch.full((1 << 20,), -1.0) for _ in range(8)]
            p = h.wait()
            del junk
            target = zeros_like(expected)
            rt.load(target, p, strict=True)
            self.assert_same(target, expected)
        finally:
            rt.close()

    def test_held_storage_moved_and_its_old_address_reused(self):
        # A held storage that moves (share_memory_, storage resize_) frees its
        # old bytes; a new tensor of the same shape may lie there, at the
        # address, shape and dtype the cache saw: the save must hold the new
        # tensor's own storage, not the moved one.
        n = 10 << 20  # 40 MiB: past glibc's mmap threshold, so a free unmaps it
        for how in ("share_memory", "storage_resize"):
            with self.subTest(how=how):
                rt = slow_runtime()
                try:
                    root = os.path.join(self.root, how)
                    if how == "share_memory":
                        # NumPy's array owns the bytes: a new tensor over it
                        # lies at the old address for sure.
                        np = __import__("numpy")
                        arr = np.ones(n, dtype=np.float32)
                        sd = {"big": torch.from_numpy(arr), "small": torch.ones(4)}
                    else:
                        sd = {"big": torch.ones(n), "small": torch.ones(4)}
                    rt.save_async(sd, root, 1).wait()
                    old = sd["big"].data_ptr()
                    if how == "share_memory":
                        sd["big"].share_memory_()  # moved to shared memory, arr let go
                        moved = sd["big"]
                        arr.fill(5.0)
                        sd["big"] = torch.from_numpy(arr)
                        del arr  # the new tensor's storage alone keeps it
                    else:
                        sd["big"].storage().resize_(2 * n)
                        moved = sd["big"]
                        # The kernel maps the freed range again, perhaps
                        # after other holes.
                        tries = [torch.empty(n) for _ in range(8)]
                        there = [t for t in tries if t.data_ptr() == old]
                        del tries
                        if not there:
                            self.skipTest("the allocator did not reuse the freed range")
                        sd["big"] = there.pop().fill_(5.0)
                    self.assertEqual(sd["big"].data_ptr(), old)
                    expected = clone(sd)
                    hits = rt._save_cache.hits
                    h = rt.save_async(sd, root, 2)
                    self.assertEqual(rt._save_cache.hits, hits + 1)
                    self.assert_held(h, list(sd.values()))
                    self.assertFalse(h.snapshot_done())
                    sd["big"].set_()  # its storage, and so its bytes, may go now
                    junk = torch.full((n,), -1.0)  # reuses them if they went
                    p = h.wait()
                    del junk, moved
                    target = zeros_like(expected)
                    rt.load(target, p, strict=True)
                    self.assert_same(target, expected)
                finally:
                    rt.close()

class GpuStoragesNotKept(unittest.TestCase):
    """The cache keeps no storage of an entry not on the CPU from one save
    to the next: that save's handle alone holds it, until its snapshot is
    done. No GPU here: chosen CPU tensors are reported on cuda:0 by the
    device getters the cache and _pack read (the C state dict takes a CUDA
    entry without touching it); the cache is driven without a save."""

    def setUp(self):
        self.gpu = set()  # ids of the tensors reported on the GPU
        cuda = torch.device("cuda", 0)
        self.saved = (_save_cache._is_cpu, _save_cache._device, _pack._device)
        _save_cache._is_cpu = lambda t: id(t) not in self.gpu
        _save_cache._device = _pack._device = lambda t: cuda if id(t) in self.gpu else t.device
        self.cache = _save_cache.SaveCache()

    def tearDown(self):
        self.cache.close()
        _save_cache._is_cpu, _save_cache._device, _pack._device = self.saved

    def owner(self):
        """A tensor over a NumPy array, and a weak reference to the array:
        dead once no storage of the tensor is held."""
        arr = __import__("numpy").ones(1000, dtype="float32")
        return torch.from_numpy(arr), weakref.ref(arr)

    def prepare(self, sd):
        p = self.cache.prepare(sd, None, None)  # no walk: the cache must answer
        self.assertIsNotNone(p.sd)
        for i, (s, t) in enumerate(zip(p.storages, sd.values())):
            self.assertEqual(s.data_ptr(), t.data_ptr(), "the save holds entry %d" % i)
        return p

    def test_storages_of_gpu_entries_are_not_kept(self):
        sd = state(3, n=8)
        sd["g"], g_arr = self.owner()
        sd["c"], c_arr = self.owner()
        self.gpu.add(id(sd["g"]))
        for hits in (0, 1):  # the first save, then a cached one
            p = self.prepare(sd)
            self.assertEqual(self.cache.hits, hits)
            self.assertTrue(p.any_cuda)
        del p, sd["g"], sd["c"]
        self.assertIsNone(g_arr(), "the cache still holds the GPU entry's storage")
        self.assertIsNotNone(c_arr(), "the cache holds the CPU entries' storages")

    def test_entry_moved_to_and_from_the_gpu(self):
        sd = state(4, n=8)
        sd["a"], a_arr = self.owner()
        sd["b"], b_arr = self.owner()
        self.gpu.add(id(sd["a"]))
        self.prepare(sd)
        # One change in ten: a cached save replaces both entries.
        sd["a"], a2_arr = self.owner()  # "a" now on the CPU
        sd["b"], b2_arr = self.owner()
        self.gpu = {id(sd["b"])}  # "b" now on the GPU
        p = self.prepare(sd)
        self.assertEqual(self.cache.hits, 1)
        self.assertTrue(p.any_cuda)
        del p, sd["a"], sd["b"]
        self.assertIsNone(a_arr())
        self.assertIsNone(b_arr())
        self.assertIsNone(b2_arr(), "the cache still holds the GPU entry's storage")
        self.assertIsNotNone(a2_arr(), "the cache holds the CPU entries' storages")
        sd.pop("w0")
        sd["w0"] = torch.ones(4, 3)  # the same keys in another order: not the cached shape
        self.gpu.clear()
        self.assertFalse(self.prepare(sd).any_cuda)


class MutationCheck(unittest.TestCase):
    """A cached save keeps the snapshot check (ferry_save_request.snapshot_check of a prepared state dict)."""

    def test_change_during_a_cached_snapshot_fails_naming_the_tensor(self):
        root = tempfile.mkdtemp(prefix="ferry_save_cache_mut_")
        rt = slow_runtime()
        try:
            big = torch.zeros(8 << 20)
            small = torch.ones(16)
            sd = {"big": big, "opt.small": small}
            rt.save_async(sd, root, 1).wait()
            hits = rt._save_cache.hits
            h = rt.save_async(sd, root, 2)
            self.assertEqual(rt._save_cache.hits, hits + 1)
            self.assertFalse(h.snapshot_done())
            small.mul_(2)
            with self.assertRaises(ferry.FerryError) as cm:
                h.wait_snapshot()
            self.assertIn("'opt.small'", str(cm.exception))
            self.assertNotIn("'big'", str(cm.exception))
            with self.assertRaises(ferry.FerryError):
                h.wait()
            self.assertEqual(ferry.list_steps(root), [1])
        finally:
            rt.close()
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    unittest.main(verbosity=2)
