"""Python on an s3:// root, against the S3 tests' server (tests/s3):
ferry.save_async(sd, "s3://bucket/run1", step) commits, ferry.latest and
ferry.list_steps see it, ferry.load restores every byte, and a step saved
twice is refused. The endpoint comes from FERRY_CONFIG, the credentials from
the AWS_* variables.

Run by ctest with the s3server fixture. Exits 77 (skipped) when torch is not
importable or the server could not start, unless FERRY_REQUIRE_S3=1."""

import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "python"))
import _support  # noqa: F401,E402 (exits 77 without torch)
import torch  # noqa: E402


def server_env():
    path = os.environ.get("FERRY_S3_ENV", "")
    env = {}
    if path and os.path.exists(path):
        for line in open(path):
            k, _, v = line.strip().partition("=")
            if k:
                env[k] = v
    why = env.get("FERRY_S3_UNAVAILABLE") or ("" if env else "no server env file at '%s'" % path)
    if why:
        if os.environ.get("FERRY_REQUIRE_S3") == "1":
            print("FAIL: FERRY_REQUIRE_S3=1 but no S3 server: " + why)
            sys.exit(1)
        print("SKIP: no S3 server: " + why)
        sys.exit(77)
    return env


ENV = server_env()
os.environ.update({k: ENV[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")})
CONFIG = tempfile.NamedTemporaryFile("w", suffix=".ini", delete=False)
CONFIG.write('[ferry]\ns3-endpoint = "%s"\n' % ENV["FERRY_S3_ENDPOINT"])
CONFIG.close()
os.environ["FERRY_CONFIG"] = CONFIG.name

import ferry  # noqa: E402


def make_bucket(name):
    """curl signs the bucket's creation itself: the package has no S3 calls of its own."""
    subprocess.run(["curl", "-sf", "-X", "PUT", "--aws-sigv4", "aws:amz:%s:s3" % ENV["AWS_REGION"],
                    "--user", "%s:%s" % (ENV["AWS_ACCESS_KEY_ID"], ENV["AWS_SECRET_ACCESS_KEY"]),
                    "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD",
                    "%s/%s" % (ENV["FERRY_S3_ENDPOINT"], name)], check=True)


class S3Root(unittest.TestCase):
    def test_save_async_load_latest(self):
        bucket = "ferry-py-%d" % os.getpid()
        make_bucket(bucket)
        root = "s3://%s/run1" % bucket
        g = torch.Generator().manual_seed(3)
        sd = {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(77, generator=g),
              "step": torch.tensor(5)}
        h = ferry.save_async(sd, root, 1)
        self.assertEqual(h.wait(), root + "/step-00000001")
        sd2 = {k: v + 1 for k, v in sd.items()}
        self.assertEqual(ferry.save_async(sd2, root, 2).wait(), root + "/step-00000002")
        self.assertEqual(ferry.latest(root), root + "/step-00000002")
        self.assertEqual(sorted(ferry.list_steps(root)), [1, 2])

        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        ferry.load(target, root)
        for k in sd:
            self.assertTrue(torch.equal(target[k], sd2[k]), k)
        ferry.load(target, root + "/step-00000001")
        for k in sd:
            self.assertTrue(torch.equal(target[k], sd[k]), k)

        with self.assertRaises(ferry.FerryError) as e:
            ferry.save_async(sd, root, 1).wait()
        self.assertIn("step-00000001", str(e.exception))

    def test_checkpoint_manager_keeps_the_last_two(self):
        bucket = "ferry-py-mgr-%d" % os.getpid()
        make_bucket(bucket)
        root = "s3://%s/run1" % bucket
        w = torch.zeros(1000)
        with ferry.CheckpointManager(root, keep_last=2) as mgr:
            self.assertIsNone(mgr.latest_step())
            self.assertEqual(mgr.all_steps(), [])
            for step in range(1, 5):
                w.fill_(step)
                self.assertTrue(mgr.save(step, {"w": w}))
        self.assertEqual(mgr.all_steps(), [3, 4])
        self.assertEqual(mgr.latest_step(), 4)
        self.assertTrue(torch.equal(mgr.restore()["w"], torch.full((1000,), 4.0)))
        self.assertTrue(torch.equal(mgr.restore(step=3)["w"], torch.full((1000,), 3.0)))


if __name__ == "__main__":
    try:
        unittest.main()
    finally:
        os.unlink(CONFIG.name)
