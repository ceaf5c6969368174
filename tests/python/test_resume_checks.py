"""A resume is exactly right or the save fails loudly (issue 41): a tensor
whose value differs by rank under one key is refused, naming it, instead of
being saved as one rank's value; a save only rank 0 calls says why it fails;
optimizer state is keyed by parameter name, so two pipeline stages whose
torch ids are alike each load their own."""

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
           os.path.join(HERE, "resume_checks_worker.py")] + list(args)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    print(p.stdout)
    return p


def main():
    root = tempfile.mkdtemp(prefix="ferry_py_resume_")
    try:
        p = launch(2, "differ", os.path.join(root, "differ"))
        assert p.stdout.count("refused:") == 2, p.stdout
        assert "tensor 'noise'" in p.stdout and "rank 0" in p.stdout and "rank 1" in p.stdout, p.stdout
        assert "saved: wrong" not in p.stdout, p.stdout
        os.makedirs(os.path.join(root, "only"))
        p = launch(2, "rank0-only", os.path.join(root, "only"))
        assert p.stdout.count("refused after") == 1, p.stdout
        assert "rank 0 is saving step 5; the other ranks have not started Ferry" in p.stdout, p.stdout
        assert ("every rank starts Ferry and calls save_async (or load) with its own shards, "
                "even for replicated state" in p.stdout), p.stdout
        took = float(re.search(r"refused after ([0-9.]+) s", p.stdout).group(1))
        assert took < 15, p.stdout

        pipe = os.path.join(root, "pipe")
        p = launch(2, "pipeline-save", pipe)
        assert p.returncode == 0 and p.stdout.count("pipeline saved") == 2, p.stdout
        sys.path.insert(0, os.path.join(os.environ["FERRY_SOURCE_DIR"], "python"))
        import ferry

        keys = set(ferry.read_manifest(ferry.latest(pipe)).tensors)
        assert "optim.state.layers.2.weight.exp_avg" in keys, sorted(keys)
        assert not any(k.startswith("optim.state.0.") for k in keys), sorted(keys)
        p = launch(2, "pipeline-load", pipe)
        assert p.returncode == 0, p.stdout
        assert p.stdout.count("loaded its own optimizer state: ok") == 2, p.stdout
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("differing replicas refused; a save on rank 0 alone says why: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
