"""One rank of a job started by `ferry launch`, for tests/python/test_plan_files.py:

  matrix ROOT   every combination of compress / shard_size / filename prefix /
                checkpoint_fn through the DCP-style steps, on sharded and
                replicated tensors: the files each rank's plan names are the
                files written, holding exactly the planned entries, and each
                checkpoint loads back equal
  dcp DIR       no root configured: SavePlanner(sd, "DIR/my_checkpoint") and a
                bare "my_checkpoint" (in the working directory), with and without
                CheckpointOptions(compress=True, shard_size=...) and checkpoint_fn
  torchsave DIR a checkpoint_fn that writes torch.save output: a clear error
Prints "ok <what>" per check passed; any failure raises."""

import json
import os
import struct
import sys

import torch

import ferry
from planner_worker import write_safetensors

ferry.configure(pool_bytes="16MiB", chunk_bytes="256KiB")


def state_dict(rank, world, seed=0):
    """A row shard zstd shrinks, a replicated tensor, and one of this rank's own."""
    full = (torch.arange(96 * 512, dtype=torch.float32).reshape(96, 512) % 97) + seed
    g = torch.Generator().manual_seed(7 + seed)
    return {
        "shard": ferry.row_shard(full, rank, world),
        "rep": torch.randn(200, 300, generator=g),  # every rank holds it alike
        "own%d" % rank: torch.full((8,), float(rank + seed)),
    }


def entries_in(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return set(k for k in json.loads(f.read(n)) if k != "__metadata__")


def planned_entries(plan):
    out = dict((f, set()) for f in plan.files)
    for w in plan.writes:
        key = plan.items[w["item"]]["key"]
        out[plan.files[w["file"]]].add("%s@%s" % (key, ",".join(str(o) for o in w["offsets"])))
    return out


def check_files(step_dir, plans, rank):
    """This rank's planned files are on disk holding exactly the planned
    entries; no rank wrote a file its plan does not name."""
    on_disk = set(f for f in os.listdir(step_dir) if f.endswith((".safetensors", ".ferryz")))
    named = set(f for p in plans for f in p.files)
    assert on_disk == named, (sorted(on_disk), sorted(named))
    for f, entries in planned_entries(plans[rank]).items():
        got = entries_in(os.path.join(step_dir, f))
        assert got == entries, (f, sorted(got), sorted(entries))
        assert ("-> " + f) in str(plans[rank]), str(plans[rank])


def check_loads(step_dir, rank, world):
    want = state_dict(rank, world)
    back = state_dict(rank, world, seed=50)
    ferry.load(back, step_dir, strict=False)  # the other ranks' own tensors are not asked for
    for k in want:
        t = back[k].tensor if isinstance(back[k], ferry.Shard) else back[k]
        w = want[k].tensor if isinstance(want[k], ferry.Shard) else want[k]
        assert torch.equal(t, w), k


def steps(planner, rank):
    """The literal sequence of the planner API."""
    global_plan = planner.create_global_plan()
    for r, plan in enumerate(global_plan):
        if r == ferry.rank():
            ferry.save_on_this_process(plan)
    return global_plan, ferry.barrier()


def matrix(root, rank, world):
    step = 0
    for compress in (None, True):
        for shard_size in (None, 1 << 16):
            for prefix in ("rank", "model_v3"):
                for with_fn in (False, True):
                    what = "compress=%s shard_size=%s prefix=%s checkpoint_fn=%s" % (
                        compress, shard_size, prefix, with_fn)
                    written = []

                    def fn(sd, filename):
                        written.append(os.path.basename(filename))
                        write_safetensors(sd, filename)

                    planner = ferry.SavePlanner(
                        state_dict(rank, world), prefix,
                        ferry.CheckpointOptions(compress=compress, shard_size=shard_size),
                        checkpoint_fn=fn if with_fn else None, root=root, step=step)
                    step += 1
                    plans, path = steps(planner, rank)
                    check_files(path, plans, rank)
                    mine = plans[rank].files
                    assert all(f.startswith("%s-%05d-" % (prefix, rank)) for f in mine), mine
                    ext = ".ferryz" if compress and not with_fn else ".safetensors"
                    assert all(f.endswith(ext) for f in mine), mine
                    if shard_size and rank == 0:
                        assert len(mine) > 2, mine  # the cap split the tensors
                    if with_fn:
                        assert written == mine, (written, mine)
                    check_loads(path, rank, world)
                    print("ok %s" % what, flush=True)


def dcp(where, rank, world):
    os.chdir(where)
    for prefix in (os.path.join(where, "ckpt", "my_checkpoint"), "my_checkpoint"):
        step = 0
        for options in (None, ferry.CheckpointOptions(compress=True, shard_size=1 << 16)):
            for with_fn in (False, True):
                planner = ferry.SavePlanner(state_dict(rank, world), prefix, options,
                                            checkpoint_fn=write_safetensors if with_fn else None)
                plans, path = steps(planner, rank)
                root = os.path.dirname(os.path.abspath(prefix))
                assert os.path.dirname(path) == root, (path, root)
                assert os.path.basename(path) == "step-%08d" % step, path
                step += 1
                check_files(path, plans, rank)
                assert all(f.startswith("my_checkpoint-") for f in plans[rank].files)
                check_loads(path, rank, world)
                print("ok dcp %s options=%s checkpoint_fn=%s" % (prefix, options is not None,
                                                                  with_fn), flush=True)


def torchsave(where, rank, world):
    planner = ferry.SavePlanner(state_dict(rank, world), os.path.join(where, "my_checkpoint"),
                                checkpoint_fn=lambda sd, filename: torch.save(sd, filename))
    try:
        steps(planner, rank)
    except ferry.FerryError as e:
        assert "torch.save's format" in str(e), e
        print("ok torch.save refused: %s" % e, flush=True)
        return
    raise AssertionError("a checkpoint_fn writing torch.save output was committed")


def main():
    mode, where = sys.argv[1], sys.argv[2]
    rt = ferry.default_runtime()
    rank, world = rt.rank, rt.world_size
    {"matrix": matrix, "dcp": dcp, "torchsave": torchsave}[mode](where, rank, world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
