"""ferry.SavePlanner from Python across processes (2 and 4 ranks under
`ferry launch`): the steps commit a checkpoint that 3 ranks load with
another sharding; the pure ferry.plan.global_plan, fed the local plans the
ranks printed, gives exactly the plans the job negotiated; another rank's
plan is refused; a Python checkpoint_fn gets the planned tensors, and one
that raises on one rank fails the checkpoint on every rank; a
transform_local_plan drops and renames keys and owner_policy lowest_rank puts
every replicated tensor in rank 0's files; a transform that raises on one rank
fails the checkpoint on every rank with its message."""

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

import _support  # noqa: F401 (exits 77, skipped, without torch)

import ferry
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(n, script, *args):
    cmd = [os.environ["FERRY_CLI"], "launch", "-n", str(n), "--", sys.executable,
           os.path.join(HERE, script)] + list(args)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    print(p.stdout)
    return p


def replay(out, n):
    """The pure planner on the printed local plans must give the printed global plan."""
    local = dict((int(r), bytes.fromhex(h)) for r, h in re.findall(r"LOCAL (\d+) ([0-9a-f]+)", out))
    negotiated = dict((int(r), bytes.fromhex(h))
                      for r, h in re.findall(r"GLOBAL (\d+) ([0-9a-f]+)", out))
    assert sorted(local) == list(range(n)) and sorted(negotiated) == list(range(n)), out
    plans = ferry.plan.global_plan([local[r] for r in range(n)])
    assert [p.to_bytes() for p in plans] == [negotiated[r] for r in range(n)]
    assert sum(p.bytes for p in plans) > 0
    assert "written by rank" in str(plans[0])
    named = ferry.plan.global_plan([local[r] for r in range(n)],
                                   options=ferry.CheckpointOptions(filename_prefix="model"))
    assert all(f.startswith("model-%05d-" % p.rank) for p in named for f in p.files), named
    assert [len(p.files) for p in named] == [len(p.files) for p in plans]
    try:
        ferry.plan.global_plan([local[0]], options={"filename_prefix": "model"})
        raise AssertionError("a dict was accepted as options")
    except ferry.FerryError as e:
        assert "CheckpointOptions" in str(e), e
    lowest = ferry.plan.global_plan([local[r] for r in range(n)], owner_policy="lowest_rank")
    for p in lowest:  # the replicated bias: written by rank 0 alone
        for item in p.items:
            if item["key"] == "bias":
                assert item["owners"] == [0], item
    try:
        ferry.plan.global_plan([local[r] for r in reversed(range(n))])
        raise AssertionError("plans out of rank order were accepted")
    except ferry.FerryError as e:
        assert "local_plans[0] is rank" in str(e), e


def safetensors_keys(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return set(k.split("@")[0] for k in header if k != "__metadata__")


def transform_and_owner_policy():
    """transform_local_plan drops and renames keys; owner_policy lowest_rank
    puts every replicated tensor in rank 0's files; a raising transform fails
    the checkpoint on every rank with its message."""
    root = tempfile.mkdtemp(prefix="ferry_py_planner_")
    try:
        p = launch(2, "planner_worker.py", "transform", root)
        assert p.returncode == 0, "transform with 2 ranks failed"
        assert p.stdout.count(" saved ") == 2, p.stdout
        path = ferry.latest(root)
        reps = set("rep%d" % i for i in range(6))
        assert set(ferry.read_manifest(path).tensors) == reps | {"new_name"}
        by_rank = {0: set(), 1: set()}
        for f in os.listdir(path):
            if f.endswith(".safetensors"):
                by_rank[int(f.split("-")[1])] |= safetensors_keys(os.path.join(path, f))
        assert reps <= by_rank[0] and not (reps & by_rank[1]), by_rank
        assert "new_name" in by_rank[0] and "new_name" in by_rank[1], by_rank
        # The renamed tensor loads under its new key.
        sd = {"new_name": torch.zeros(10, 4)}
        ferry.load(sd, path, strict=False)
        assert torch.equal(sd["new_name"], torch.arange(40, dtype=torch.float32).reshape(10, 4))
        # The same local plans with the balanced policy would have put some
        # replicas on rank 1: the option made the difference.
        local = [bytes.fromhex(h) for _, h in
                 sorted(re.findall(r"LOCAL (\d+) ([0-9a-f]+)", p.stdout))]
        balanced = ferry.plan.global_plan(local, owner_policy="balanced")
        assert any(it["owners"] != [0] for it in balanced[1].items if it["key"] in reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    root = tempfile.mkdtemp(prefix="ferry_py_planner_")
    try:
        p = launch(2, "planner_worker.py", "transform-raise", root)
        assert p.returncode == 0, "a raising transform did not fail every rank"
        failed = re.findall(r"^\[rank \d+\] rank \d+ failed: .*$", p.stdout, re.M)
        assert len(failed) == 2 and all("ValueError: planned transform bug" in f
                                        for f in failed), p.stdout
        assert ferry.list_steps(root) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main():
    for n in (2, 4):
        for mode in ("save", "save-fn"):
            root = tempfile.mkdtemp(prefix="ferry_py_planner_")
            try:
                p = launch(n, "planner_worker.py", mode, root)
                assert p.returncode == 0, "%s with %d ranks failed" % (mode, n)
                assert p.stdout.count("saved") == n, p.stdout
                assert p.stdout.count("refused: ") == n, p.stdout
                assert p.stdout.count("each rank saves only its own") == n, p.stdout
                if mode == "save-fn":
                    assert p.stdout.count("checkpoint_fn got the planned tensors") == n
                replay(p.stdout, n)
                p = launch(3, "reshard_worker.py", "load", root)
                assert p.returncode == 0, "load with 3 ranks failed"
                assert p.stdout.count("loaded: ok") == 3, p.stdout
            finally:
                shutil.rmtree(root, ignore_errors=True)
    # CheckpointOptions through the planner: named, compressed, capped files
    # that 3 ranks load with another sharding.
    root = tempfile.mkdtemp(prefix="ferry_py_planner_")
    try:
        p = launch(2, "planner_worker.py", "save-opts", root)
        assert p.returncode == 0, "save-opts with 2 ranks failed"
        step_dir = ferry.latest(root)
        files = sorted(f for f in os.listdir(step_dir) if f.startswith("my_checkpoint-"))
        assert files and all(f.endswith(".ferryz") for f in files), os.listdir(step_dir)
        assert len(files) > 2, files  # shard_size split the ranks' items
        assert all(os.path.getsize(os.path.join(step_dir, f)) <= 256 + 8192 for f in files)
        p = launch(3, "reshard_worker.py", "load", root)
        assert p.returncode == 0 and p.stdout.count("loaded: ok") == 3, "load of save-opts failed"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    root = tempfile.mkdtemp(prefix="ferry_py_planner_")
    try:
        p = launch(3, "planner_worker.py", "raise", root)
        assert p.returncode == 0, "a raising checkpoint_fn did not fail every rank"
        # Each rank's own verdict line (rank 0 may also log aborts it could
        # not deliver to ranks that had already exited).
        assert len(re.findall(r"^\[rank \d+\] rank \d+ failed: ", p.stdout, re.M)) == 3, p.stdout
        assert ferry.list_steps(root) == [], ferry.list_steps(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    transform_and_owner_policy()
    print("planner steps on 2 and 4 ranks, checkpoint_fn, transform_local_plan, owner_policy, "
          "pure global plan: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
