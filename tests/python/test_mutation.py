"""A tensor changed in place between save_async and the end of its snapshot
fails the save naming it (torch's version counters, compared when the
snapshot ends), or with on_mutation="warn" commits with a warning in
h.warnings(); changes after wait_snapshot, to staged copies or by t.set_()
are not mutations of what was saved, and t.resize_() waits for the snapshot. verify-snapshot (on in debug builds)
catches the same in C++ by checksums, for callers that cannot see versions.

The snapshot is held open without sleeping: a pool of 2 blocks for a 32 MiB
state, and every write slowed by the fault injector (FERRY_FAULTS latency),
so the snapshot streams for about a second after save_async returns.

Run by ctest (exit 77 = skipped when torch is not importable)."""

import os
import shutil
import tempfile
import time
import unittest

import _support  # noqa: F401 (exits 77, skipped, without torch)
import torch  # noqa: E402

import ferry

BIG = 8 << 20  # float32 elements: 32 MiB, 32 blocks of 1 MiB through a 2-block pool


def slow_runtime(**extra):
    options = {"pool_bytes": "2MiB", "chunk_bytes": "1MiB", "direct_io": False}
    options.update(extra)
    old = os.environ.get("FERRY_FAULTS")
    os.environ["FERRY_FAULTS"] = "latency:write:30ms"
    try:
        return ferry.Runtime(options, rank=0, world_size=1)
    finally:
        if old is None:
            del os.environ["FERRY_FAULTS"]
        else:
            os.environ["FERRY_FAULTS"] = old


class Base(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="ferry_py_mutation_")
        self.rt = slow_runtime()

    def tearDown(self):
        self.rt.close()
        shutil.rmtree(self.root, ignore_errors=True)


class Versions(Base):
    def test_change_during_snapshot_fails_naming_the_tensor(self):
        big = torch.zeros(BIG)
        small = torch.ones(16)
        h = self.rt.save_async({"big": big, "opt.small": small}, self.root, 1)
        self.assertFalse(h.snapshot_done())
        small.mul_(2)  # what optimizer.step() does before wait_snapshot
        with self.assertRaises(ferry.FerryError) as cm:
            h.wait_snapshot()
        msg = str(cm.exception)
        self.assertIn("'opt.small'", msg)
        self.assertNotIn("'big'", msg)
        self.assertIn("wait_snapshot", msg)
        self.assertIn("on_mutation='warn'", msg)
        with self.assertRaises(ferry.FerryError):
            h.wait()
        self.assertEqual(ferry.list_steps(self.root), [])
        # The runtime goes on: the next save commits.
        self.rt.save_async({"big": big, "opt.small": small}, self.root, 2).wait()
        self.assertEqual(ferry.list_steps(self.root), [2])

    def test_warn_commits_with_a_warning(self):
        big = torch.zeros(BIG)
        small = torch.ones(16)
        h = self.rt.save_async({"big": big, "small": small}, self.root, 1, on_mutation="warn")
        self.assertFalse(h.snapshot_done())
        big[-4:].add_(1)
        path = h.wait()
        self.assertEqual(len(h.warnings()), 1, h.warnings())
        self.assertIn("'big'", h.warnings()[0])
        self.assertNotIn("'small'", h.warnings()[0])
        self.assertTrue(os.path.isdir(path))

    def test_no_false_alarms(self):
        base = torch.arange(64.0).reshape(8, 8)
        moved = torch.ones(BIG)
        after = torch.ones(16)
        h = self.rt.save_async({"t": base.t(), "moved": moved, "after": after}, self.root, 1)
        self.assertEqual(h.staged, ["t"])
        self.assertFalse(h.snapshot_done())
        base.add_(1)  # "t" was staged: the save reads its own copy
        moved.set_(torch.zeros(4))  # other memory: the saved bytes are kept as they were
        h.wait_snapshot()
        after.add_(1)  # after the snapshot: allowed
        h.wait()
        self.assertEqual(h.warnings(), [])
        out = {"t": torch.zeros(8, 8), "moved": torch.zeros(BIG), "after": torch.zeros(16)}
        self.rt.load(out, self.root)
        self.assertTrue(torch.equal(out["t"], torch.arange(64.0).reshape(8, 8).t()))
        self.assertTrue(torch.equal(out["moved"], torch.ones(BIG)))
        self.assertTrue(torch.equal(out["after"], torch.ones(16)))

    def test_resize_waits_for_the_snapshot(self):
        # resize_ reallocates in place (freeing what the snapshot copies from)
        # and torch does not bump _version: it waits for the snapshot instead.
        for how in ("tensor", "resize_as_", "storage"):
            with self.subTest(how=how):
                root = os.path.join(self.root, how)
                t = torch.ones(BIG)
                h = self.rt.save_async({"w": t}, root, 1)
                self.assertFalse(h.snapshot_done())
                if how == "tensor":
                    t.resize_(BIG * 4)
                elif how == "resize_as_":
                    t.resize_as_(torch.empty(BIG * 4))
                else:
                    t.storage().resize_(BIG * 4)
                self.assertTrue(h.snapshot_done())
                # Memory freed by the resize would be unmapped or reused by these.
                junk = [torch.full((1 << 22,), 7.0) for _ in range(8)]
                h.wait()
                del junk
                self.assertEqual(h.warnings(), [])
                out = {"w": torch.zeros(BIG)}
                self.rt.load(out, root)
                self.assertTrue(torch.equal(out["w"], torch.ones(BIG)))

    def test_bad_on_mutation(self):
        with self.assertRaises(ferry.FerryError) as cm:
            self.rt.save_async({"w": torch.ones(2)}, self.root, 1, on_mutation="maybe")
        self.assertIn("on_mutation", str(cm.exception))


class VerifySnapshot(unittest.TestCase):
    def test_checksums_catch_a_change_the_versions_do_not_see(self):
        root = tempfile.mkdtemp(prefix="ferry_py_verify_")
        rt = slow_runtime(verify_snapshot=True)
        try:
            big = torch.zeros(BIG)
            h = rt.save_async({"w": torch.ones(4), "big": big}, root, 1, on_mutation="ignore")
            # Once a block is written the sums were taken; the tail is copied
            # last, about a second later.
            deadline = time.monotonic() + 30
            while h.metrics()["bytes_persisted"] == 0 and time.monotonic() < deadline:
                pass
            self.assertFalse(h.snapshot_done())
            big[-1024:].fill_(3.0)
            with self.assertRaises(ferry.FerryError) as cm:
                h.wait()
            self.assertIn("tensor 'big' changed while the snapshot copied it", str(cm.exception))
            self.assertEqual(ferry.list_steps(root), [])
        finally:
            rt.close()
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    unittest.main(verbosity=2)
