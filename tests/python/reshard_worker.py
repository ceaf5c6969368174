"""One rank of a job started by `ferry launch`: `save ROOT` saves sharded
tensors from every rank; `load ROOT` loads them back with the current
world size's sharding (any) and checks every element. `race ROOT` (2
ranks): a step commits while the ranks load ROOT's latest, after rank 0
read it and before rank 1 does; every rank must get its tensors and its
leaves from the same step."""

import os
import sys
import time

import torch

import ferry

ferry.configure(pool_bytes="16MiB", chunk_bytes="256KiB")


def globals_():
    g = torch.Generator().manual_seed(42)
    return {
        "w": torch.randn(10, 6, generator=g),
        "c": torch.randn(5, 9, generator=g).double(),
        "flat": torch.randint(-1000, 1000, (23,), generator=g, dtype=torch.int32),
        "bias": torch.randn(7, generator=g).half(),
    }


def saved_state_dict(rank, world):
    """What `save` saves (also tests/python/planner_worker.py)."""
    full = globals_()
    a, b = ferry.split_range(23, rank, world)
    return {
        "layer": {"w": ferry.row_shard(full["w"], rank, world)},
        "c": ferry.col_shard(full["c"], rank, world),  # non-contiguous: staged
        "flat": ferry.flat_shard(full["flat"][a:b].clone(), 23, a),
        "bias": full["bias"],  # replicated on every rank
        "epoch": 3,
    }


def main():
    mode, root = sys.argv[1], sys.argv[2]
    rt = ferry.default_runtime()
    rank, world = rt.rank, rt.world_size
    assert (rank, world) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    full = globals_()
    if mode == "race":
        return race(rank, root)
    if mode == "save":
        sd = saved_state_dict(rank, world)
        h = ferry.save_async(sd, root, 100)
        h.wait()
        print("rank %d of %d saved %s" % (rank, world, h.path), flush=True)
        return 0
    # load: rows for w, *rows* for c (saved as columns), flat slices, bias whole.
    a, b = ferry.split_range(23, rank, world)
    sd = {
        "layer": {"w": ferry.row_shard((10, 6), rank, world, dtype=torch.float32)},
        "c": ferry.row_shard((5, 9), rank, world, dtype=torch.float64),
        "flat": ferry.flat_shard(torch.zeros(b - a, dtype=torch.int32), 23, a),
        "bias": torch.zeros(7, dtype=torch.float16),
        "epoch": 0,
    }
    st = ferry.load(sd, root).stats
    s, e = ferry.split_range(10, rank, world)
    ok = torch.equal(sd["layer"]["w"].tensor, full["w"][s:e])
    s, e = ferry.split_range(5, rank, world)
    ok &= torch.equal(sd["c"].tensor, full["c"][s:e])
    ok &= torch.equal(sd["flat"].tensor, full["flat"][a:b])
    ok &= torch.equal(sd["bias"], full["bias"])
    ok &= sd["epoch"] == 3
    print("rank %d of %d loaded: %s" % (rank, world, "ok" if ok else "MISMATCH"), flush=True)
    print("rank %d stats: received %d in_memory %d" % (rank, st["bytes_received"],
                                                       st["shared_in_memory"]), flush=True)
    return 0 if ok else 1


def race(rank, root):
    ferry.save({"w": torch.full((4,), 1.0), "epoch": 1}, root, 1)
    marker = root + ".rank0-read"
    if rank == 0:
        real = ferry._core.Manifest

        class Marked(real):  # the moment rank 0 has read the manifest of its load
            def __init__(self, path, *rest):
                super().__init__(path, *rest)
                open(marker, "w").close()

        ferry._core.Manifest = Marked
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker):
            assert time.monotonic() < deadline, "rank 0 never read its manifest"
            time.sleep(0.01)
        # Another job commits step 2 into the root now.
        other = ferry.Runtime(rank=0, world_size=1)
        other.save_async({"w": torch.full((4,), 2.0), "epoch": 2}, root, 2).wait()
        other.close()
    target = {"w": torch.zeros(4), "epoch": 0}
    res = ferry.load(target, root)
    w = target["w"][0].item()
    step = getattr(res, "step", None)
    ok = torch.equal(target["w"], torch.full((4,), float(target["epoch"]))) and step == w
    print("rank %d race: epoch %d w %g step %s: %s" % (rank, target["epoch"], w, step,
                                                       "ok" if ok else "MIXED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
