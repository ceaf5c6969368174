"""The planner says what it does (tests/python/plan_files_worker.py does the
work on each rank): on 1, 2 and 3 ranks, every combination of compress,
shard_size, filename prefix and checkpoint_fn commits exactly the files each
rank's plan names, holding the planned entries, and loads back; with no root
configured the DCP-style calls put the checkpoint where the prefix says; a
checkpoint_fn that writes torch.save output fails the save, committing
nothing."""

import os
import shutil
import subprocess
import sys
import tempfile

import _support  # noqa: F401 (exits 77, skipped, without torch)

import ferry

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(n, *args):
    cmd = [os.environ["FERRY_CLI"], "launch", "-n", str(n), "--", sys.executable,
           os.path.join(HERE, "plan_files_worker.py")] + list(args)
    env = dict(os.environ)
    env.pop("FERRY_ROOT", None)  # no root anywhere
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=240, env=env)
    print(p.stdout)
    return p


def main():
    for n in (1, 2, 3):
        d = tempfile.mkdtemp(prefix="ferry_py_plan_files_")
        try:
            p = launch(n, "matrix", d)
            assert p.returncode == 0, "matrix on %d ranks failed" % n
            assert p.stdout.count("ok compress=") == 16 * n, p.stdout
        finally:
            shutil.rmtree(d, ignore_errors=True)
    for n in (1, 2):
        d = tempfile.mkdtemp(prefix="ferry_py_plan_files_")
        try:
            p = launch(n, "dcp", d)
            assert p.returncode == 0, "the DCP-style calls on %d ranks failed" % n
            assert p.stdout.count("ok dcp ") == 8 * n, p.stdout
            assert len(ferry.list_steps(os.path.join(d, "ckpt"))) == 4
            assert len(ferry.list_steps(d)) == 4
        finally:
            shutil.rmtree(d, ignore_errors=True)
        d = tempfile.mkdtemp(prefix="ferry_py_plan_files_")
        try:
            p = launch(n, "torchsave", d)
            assert p.returncode == 0, "torch.save output on %d ranks was not refused" % n
            assert "torch.save's format" in p.stdout, p.stdout
            assert ferry.list_steps(d) == [], ferry.list_steps(d)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    print("plan files: the plan names the files written, on 1-3 ranks; DCP-style calls "
          "without a root; torch.save output refused: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
