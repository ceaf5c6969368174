"""ferry.CheckpointOptions end to end: compressed, capped and prefixed data
files round trip every dtype, whole and resharded; bad options raise
FerryError naming the option.

Run by ctest (exit 77 = skipped when torch is not importable)."""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

import _support  # noqa: F401 (exits 77, skipped, without torch)
import torch  # noqa: E402

import ferry

ferry.configure(pool_bytes="32MiB", chunk_bytes="1MiB")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]


def filled(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g, dtype=torch.int64).to(dtype)


def same_bytes(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


class CheckpointOptionsTest(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="ferry-py-options-")

    def tearDown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    def test_round_trip_compressed_capped_prefixed(self):
        sd = {"t%d" % i: filled((600, 300), dt, i) for i, dt in enumerate(DTYPES)}
        options = ferry.CheckpointOptions(compress=True, shard_size=1 << 20,
                                          filename_prefix="model.v1")
        path = ferry.save_async(sd, self.root, 3, options=options).wait()
        names = sorted(os.listdir(path))
        data = [n for n in names if n != "MANIFEST"]
        self.assertTrue(data)
        for n in data:
            self.assertTrue(n.startswith("model.v1-00000-") and n.endswith(".ferryz"), n)
        # 6.2 MB raw under a 1 MiB cap: split over several files.
        self.assertGreater(len(data), 5)

        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        ferry.load(out, path)
        for k in sd:
            self.assertTrue(same_bytes(out[k], sd[k]), k)
        # Resharded: the middle third of the rows of two tensors.
        for k in ("t0", "t1"):
            part = {k: ferry.row_shard((600, 300), 1, 3, dtype=sd[k].dtype)}
            ferry.load(part, path, strict=False)
            self.assertTrue(same_bytes(part[k].tensor, sd[k][200:400]), k)

    def test_zstd_level_and_plain(self):
        sd = {"w": filled((256, 256), torch.float32, 1)}
        for i, c in enumerate(["zstd:1", "none", False]):
            path = ferry.save(sd, self.root, 10 + i, options=ferry.CheckpointOptions(compress=c))
            ext = ".ferryz" if c == "zstd:1" else ".safetensors"
            self.assertEqual(sorted(os.listdir(path)), ["MANIFEST", "rank-00000-0000" + ext])
            out = {"w": torch.zeros(256, 256)}
            ferry.load(out, path)
            self.assertTrue(same_bytes(out["w"], sd["w"]))

    def test_bad_options_name_the_option(self):
        sd = {"w": torch.ones(4)}
        for bad in (0, -1, True, 1.5):
            with self.assertRaisesRegex(ferry.FerryError, "shard_size"):
                ferry.CheckpointOptions(shard_size=bad)
        for prefix in ("a/b", "..", "", "x y"):
            with self.assertRaisesRegex(ferry.FerryError, "filename_prefix"):
                ferry.save(sd, self.root, 20, options=ferry.CheckpointOptions(
                    filename_prefix=prefix))
        with self.assertRaisesRegex(ferry.FerryError, "compress"):
            ferry.save(sd, self.root, 21, options=ferry.CheckpointOptions(compress="gzip"))
        with self.assertRaisesRegex(ferry.FerryError, "CheckpointOptions"):
            ferry.save(sd, self.root, 22, options={"compress": True})


# A fresh process with the default options (no configure()): its resident
# memory after saving and loading a 9M-parameter model.
_RSS_SCRIPT = textwrap.dedent("""
    import sys, torch, ferry

    def rss_mib():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(9)])
    sd = model.state_dict()
    before = rss_mib()
    rt = ferry.Runtime({}, rank=0, world_size=1)
    rt.save_async(sd, sys.argv[1], 1).wait()
    path = rt.save_async(sd, sys.argv[1], 2).wait()
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    rt.load(back, path)
    assert all(torch.equal(back[k], sd[k]) for k in sd), "loaded bytes differ"
    print("%.0f %.0f" % (before, rss_mib() - before))
    rt.close()
""")


class DefaultPool(unittest.TestCase):
    def test_default_pool_grows_with_the_state_not_to_1gib(self):
        d = tempfile.mkdtemp(prefix="ferry-rss-")
        try:
            env = dict(os.environ)
            env.pop("FERRY_CONFIG", None)
            out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, d], env=env, check=True,
                                 capture_output=True, text=True, timeout=300).stdout.split()
            before, grew = float(out[-2]), float(out[-1])
            # 36 MiB loaded into new tensors, two 32 MiB blocks of pool, the
            # library's threads (about 110 MiB here); a fixed 1 GiB pool's
            # background faulting had added 150 MiB more by then (and 1 GiB
            # in the end).
            self.assertLess(grew, 160, "RSS %.0f MiB grew by %.0f MiB" % (before, grew))
        finally:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
