"""Per-rank state (issue 41, 1): RNG states, a data loader's position and
ferry.per_rank values saved by 2 ranks are stored once per rank (never as a
replica), come back to each rank its own on 2 ranks, and on 3 or 1 ranks
follow on_resize: "error" names the key and both world sizes, "first" gives
rank 0's, a function chooses from all saved values."""

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
           os.path.join(HERE, "per_rank_worker.py")] + list(args)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    print(p.stdout)
    return p


def got(out):
    """rank -> the rank whose values it got."""
    return {int(a): int(b) for a, b in re.findall(r"rank (\d+) got rank (\d+)'s values$", out, re.M)}


def main():
    sys.path.insert(0, os.path.join(os.environ["FERRY_SOURCE_DIR"], "python"))
    import ferry

    root = tempfile.mkdtemp(prefix="ferry_py_per_rank_")
    try:
        p = launch(2, "save", root)
        assert p.returncode == 0 and p.stdout.count("saved") == 2, p.stdout
        keys = set(ferry.read_manifest(ferry.latest(root)).tensors)
        for k in ("rng", "cpu_rng_state", "data.pos", "data.order", "pos"):
            assert {k + "@rank0", k + "@rank1"} <= keys and k not in keys, (k, sorted(keys))
        assert "w" in keys, sorted(keys)

        p = launch(2, "load", root, "auto")  # same world size: each rank its own
        assert got(p.stdout) == {0: 0, 1: 1}, p.stdout
        p = launch(2, "load", root, "first")  # the policy is for resizes only
        assert got(p.stdout) == {0: 0, 1: 1}, p.stdout

        for n in (3, 1):
            for policy in ("error", "auto"):
                p = launch(n, "load", root, policy)
                assert p.stdout.count("refused:") == n, p.stdout
                assert re.search(r"'(rng|cpu_rng_state|data\.\w+|pos)' is per-rank: saved by 2 "
                                 r"ranks, loaded by %d, and its on_resize policy is 'error'" % n,
                                 p.stdout), p.stdout
            p = launch(n, "load", root, "first")
            assert got(p.stdout) == {r: 0 for r in range(n)}, p.stdout
        p = launch(3, "load", root, "fn")
        assert got(p.stdout) == {0: 0, 1: 1, 2: 0}, p.stdout
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("per-rank state: own value on 2 ranks, on_resize on 3 and 1: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
