"""A state dict of 100,000 tensors costs about ten times one of 10,000
through the Python package (issue 45): the first save_async (walk, entries,
the prepared C++ state dict), a repeated one (the cache, against the
least per-tensor work at the same size), the save to
committed and the load back, whose bytes must equal the state's. The bound
is loose (25x) so a shared, loaded machine does not fail it; a quadratic
step makes 100x. And, exactly rather than by the clock: the package's own
Python runs no function per tensor in a first or repeated save_async, a
load or a manifest read of a plain state dict (one dict of tensors): those
walk their tensors column by column at C speed.

Run by ctest (exit 77 = skipped when torch is not importable)."""

import gc
import os
import shutil
import sys
import tempfile
import time
import unittest

import _support  # noqa: F401 (exits 77, skipped, without torch)
import torch  # noqa: E402

import ferry
from ferry import _pack

ELEMS = 16  # floats per tensor: the cost is per tensor, not per byte
BOUND = 25
TOUCHES = 12


def run(n):
    """Times of a state of n tensors (views into one buffer, so the bytes
    are compared in one call). The collector is off while timing: its
    pauses depend on the whole process's heap, not on the call timed."""
    gc.collect()
    gc.disable()
    try:
        return _run(n)
    finally:
        gc.enable()


def touch(sd):
    """The least any save of `sd` does per tensor, best of three: read its
    address and take a reference to its storage (the handle holds it). At
    100,000 tensors the objects no longer fit the caches and this alone costs
    about 25x what it does at 10,000: the repeated save is measured against
    it, in the same process, not against the smaller state."""
    storage = _pack.storage_fn()
    best = None
    for _ in range(3):
        t0 = time.thread_time()
        ts = list(sd.values())
        ptrs = list(map(torch.Tensor.data_ptr, ts))
        held = list(map(storage, ts))
        took = time.thread_time() - t0
        del ts, ptrs, held
        best = took if best is None else min(best, took)
    return best


def _run(n):
    d = tempfile.mkdtemp(prefix="ferry-scale-")
    rt = ferry.Runtime({"pool_bytes": "32MiB"}, rank=0, world_size=1)
    try:
        flat = torch.arange(n * ELEMS, dtype=torch.float32)
        sd = {"layers.%d.expert.w" % i: flat[i * ELEMS:(i + 1) * ELEMS] for i in range(n)}
        # save_async's own work is this thread's: its CPU time, not wall
        # time, which on a loaded machine favours a call short enough to
        # run within one time slice.
        t = {}
        t0 = time.thread_time()
        h = rt.save_async(sd, d, 1)
        t["first_save_async"] = time.thread_time() - t0
        h.wait()
        t["touch"] = touch(sd)
        # Repeated saves, the best of three (a loaded machine only adds).
        best = None
        for step in (2, 3, 4):
            flat[0] = -float(step)  # each save has its own bytes
            t0, c0 = time.perf_counter(), time.thread_time()
            h = rt.save_async(sd, d, step)
            took = time.thread_time() - c0
            path = h.wait()
            if best is None or took < best:
                best, t["save"] = took, time.perf_counter() - t0
        t["save_async"] = best
        back = torch.zeros_like(flat)
        target = {k: back[i * ELEMS:(i + 1) * ELEMS] for i, k in enumerate(sd)}
        t0 = time.perf_counter()
        rt.load(target, path)
        t["load"] = time.perf_counter() - t0
        assert torch.equal(back, flat), "the state loaded back differs"
        return t
    finally:
        rt.close()
        shutil.rmtree(d, ignore_errors=True)


PACKAGE = os.path.dirname(os.path.abspath(ferry.__file__)) + os.sep


def package_calls(f):
    """(f(), how many calls of the package's Python functions it made on
    this thread): a function run per tensor shows up as one call each."""
    n = [0]

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            n[0] += 1

    sys.setprofile(count)
    try:
        r = f()
    finally:
        sys.setprofile(None)
    return r, n[0]


def calls_of(n):
    d = tempfile.mkdtemp(prefix="ferry-scale-calls-")
    rt = ferry.Runtime({"pool_bytes": "32MiB"}, rank=0, world_size=1)
    try:
        sd = {"layers.%d.w" % i: torch.full((4,), float(i)) for i in range(n)}
        c = {}
        h, c["first_save_async"] = package_calls(lambda: rt.save_async(sd, d, 1))
        h.wait()
        h, c["save_async"] = package_calls(lambda: rt.save_async(sd, d, 2))
        path = h.wait()
        target = {k: torch.zeros(4) for k in sd}
        _, c["load"] = package_calls(lambda: rt.load(target, path))
        for k in sd:
            assert torch.equal(target[k], sd[k]), "'%s' loaded back differs" % k
        _, c["read_manifest"] = package_calls(lambda: ferry.read_manifest(path))
        return c
    finally:
        rt.close()
        shutil.rmtree(d, ignore_errors=True)


class Scale(unittest.TestCase):
    def test_no_python_call_per_tensor(self):
        small = calls_of(1_000)
        big = calls_of(10_000)
        # 9,000 more tensors: a function run per tensor adds 9,000 calls.
        for name in small:
            self.assertLessEqual(big[name], small[name] + 200,
                                 "%s: %d calls at 1,000 tensors, %d at 10,000"
                                 % (name, small[name], big[name]))

    def test_100000_tensors_cost_about_10x_10000(self):
        small = run(10_000)
        big = run(100_000)
        msg = "10,000: %s; 100,000: %s" % (
            {k: round(v, 4) for k, v in small.items()}, {k: round(v, 4) for k, v in big.items()})
        print(msg)
        self.assertLessEqual(big["first_save_async"] / max(small["first_save_async"], 1e-4),
                             BOUND, "first_save_async: " + msg)
        # A repeated save re-reads each tensor a few times: a small multiple
        # of touching each once at either size (a quadratic step is 10x more
        # at 100,000 than at 10,000).
        for name, t in (("10,000", small), ("100,000", big)):
            self.assertLessEqual(t["save_async"], TOUCHES * t["touch"] + 1e-3,
                                 "a repeated save_async of %s tensors: %s" % (name, msg))
        # The repeated save is the cache's (ferry/_save_cache.py): well under
        # the first, which walks the tree and prepares the C state dict.
        self.assertLessEqual(big["save_async"], 0.5 * big["first_save_async"], msg)
        # Save and load together: one stall of a shared disk moves either alone.
        self.assertLessEqual((big["save"] + big["load"]) / (small["save"] + small["load"]), BOUND,
                             msg)


if __name__ == "__main__":
    unittest.main(verbosity=2)
