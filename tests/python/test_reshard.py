"""Resharded load from Python across processes: 2 ranks save (row, column
and flat shards, a replicated tensor, a JSON leaf) under `ferry launch`,
then 3 ranks load with a different sharding and check every element; a
step committed during a 2-rank load of the latest does not mix steps."""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import _support  # noqa: F401 (exits 77, skipped, without torch)

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(n, *args):
    cmd = [os.environ["FERRY_CLI"], "launch", "-n", str(n), "--", sys.executable,
           os.path.join(HERE, "reshard_worker.py")] + list(args)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    print(p.stdout)
    return p


def main():
    root = tempfile.mkdtemp(prefix="ferry_py_reshard_")
    try:
        p = launch(2, "save", root)
        assert p.returncode == 0, "save with 2 ranks failed"
        assert p.stdout.count("saved") == 2, p.stdout
        p = launch(3, "load", root)
        assert p.returncode == 0, "load with 3 ranks failed"
        assert p.stdout.count("loaded: ok") == 3, p.stdout
        # Rows of one checksum block that two ranks need are read by one of
        # them and put in the other's share ring: on one node every byte a
        # rank received went through a ring.
        figures = re.findall(r"stats: received (\d+) in_memory (\d+)", p.stdout)
        assert len(figures) == 3, p.stdout
        received = sum(int(r) for r, _ in figures)
        in_memory = sum(int(m) for _, m in figures)
        assert received > 0 and received == in_memory, p.stdout
        p = launch(1, "load", root)
        assert p.returncode == 0 and "loaded: ok" in p.stdout, "load with 1 rank failed"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # Rank 0 picks the checkpoint of a root for every rank, and each rank's
    # manifest, leaves and key checks come from that one.
    root = tempfile.mkdtemp(prefix="ferry_py_race_")
    try:
        p = launch(2, "race", os.path.join(root, "ckpt"))
        assert p.returncode == 0, "a commit during a 2-rank load mixed steps"
        assert p.stdout.count("race: epoch 1 w 1 step 1: ok") == 2, p.stdout
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("reshard 2 -> 3 -> 1 ranks, one checkpoint per load: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
