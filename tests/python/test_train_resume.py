"""examples/train_resume.py: a run killed with SIGKILL at a step between two
checkpoints and resumed gives bitwise the losses of a run that never
stopped, for every step (the steps trained twice included)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

from _support import SRC  # noqa: E402 (exits 77, skipped, without torch)

EXAMPLE = os.path.join(SRC, "examples", "train_resume.py")
STEPS, CRASH, EVERY = 120, 75, 20


def run(root, losses, *extra):
    cmd = [sys.executable, EXAMPLE, "--root", root, "--steps", str(STEPS), "--save-every",
           str(EVERY), "--losses", losses] + list(extra)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=240)
    print(p.stdout)
    return p


def read(path):
    out = {}
    with open(path) as f:
        for line in f:
            step, loss = line.split()
            step = int(step)
            if step in out:
                # A step trained before the crash and again after the resume.
                assert out[step] == loss, "step %d: %s before the crash, %s after" % (
                    step, out[step], loss)
            out[step] = loss
    return out


def main():
    tmp = tempfile.mkdtemp(prefix="ferry_py_resume_")
    try:
        clean_l = os.path.join(tmp, "clean.txt")
        p = run(os.path.join(tmp, "clean"), clean_l)
        assert p.returncode == 0, "clean run failed"
        root, crash_l = os.path.join(tmp, "crash"), os.path.join(tmp, "crash.txt")
        p = run(root, crash_l, "--crash-at", str(CRASH))
        assert p.returncode == -signal.SIGKILL, "expected SIGKILL, got %s" % p.returncode
        # The newest checkpoint before the crash is step 60, unless its commit
        # was still in flight when the SIGKILL came (a loaded machine): then
        # an older one. Either way the resume must reproduce every loss.
        p = run(root, crash_l)
        assert p.returncode == 0, "resumed run failed"
        m = re.search(r"resumed from step (\d+)", p.stdout)
        assert m, p.stdout
        last_saved = int(m.group(1))
        assert last_saved % EVERY == 0 and EVERY <= last_saved <= CRASH - CRASH % EVERY, p.stdout
        clean, resumed = read(clean_l), read(crash_l)
        assert sorted(clean) == list(range(1, STEPS + 1))
        assert sorted(resumed) == list(range(1, STEPS + 1))
        diff = [s for s in clean if clean[s] != resumed[s]]
        assert not diff, "losses differ at steps %s" % diff[:10]
        print("crash at %d, resumed at %d: %d losses bitwise identical" % (
            CRASH, last_saved + 1, len(clean)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
