"""One rank of a job started by `ferry launch`, saving reshard_worker's state
dict through ferry.SavePlanner's steps (`reshard_worker.py load` checks it):

  save ROOT         Ferry writes the files
  save-fn ROOT      a Python checkpoint_fn writes them (plain safetensors)
  save-opts ROOT    Ferry writes them as my_checkpoint-*, zstd, 256 data bytes a file
  raise ROOT        rank 1's checkpoint_fn raises: every rank must fail
  transform ROOT    a transform_local_plan drops "skip_me" and renames
                    "old_name" to "new_name"; owner_policy lowest_rank
  transform-raise ROOT  rank 1's transform_local_plan raises: every rank must fail
Every rank prints its local plan and every rank's plan as hex, so the test
can replay them through the pure ferry.plan.global_plan."""

import json
import os
import struct
import sys

import torch

import ferry
from reshard_worker import saved_state_dict

ferry.configure(pool_bytes="16MiB", chunk_bytes="256KiB")

_ST_NAMES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16",
             torch.int32: "I32", torch.int64: "I64", torch.bfloat16: "BF16", torch.uint8: "U8",
             torch.int8: "I8", torch.int16: "I16", torch.bool: "BOOL"}


def write_safetensors(sd, filename):
    """What safetensors' save_file does, without the package."""
    header, blobs, off = {}, [], 0
    for key, t in sd.items():
        raw = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b""
        header[key] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode("utf-8")
    with open(filename, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def transform_state_dict(rank, world):
    """Six tensors every rank holds alike, one to drop, a row shard to rename."""
    sd = {"rep%d" % i: torch.full((16 + i,), float(i)) for i in range(6)}
    sd["skip_me"] = torch.ones(4)
    full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    sd["old_name"] = ferry.row_shard(full, rank, world)
    return sd


def transform_main(mode, root, rank, world):
    def transform(plan):
        if mode == "transform-raise" and rank == 1:
            raise ValueError("planned transform bug")
        items = [it for it in plan.items if it["key"] != "skip_me"]
        for it in items:
            if it["key"] == "old_name":
                it["key"] = "new_name"
        return items

    planner = ferry.SavePlanner(transform_state_dict(rank, world), "rank", root=root,
                                transform_local_plan=transform, owner_policy="lowest_rank")
    try:
        local = planner.create_local_plan()
        print("LOCAL %d %s" % (rank, local.to_bytes().hex()), flush=True)
        global_plan = planner.create_global_plan()
    except ferry.FerryError as e:
        print("rank %d failed: %s" % (rank, e), flush=True)
        return 0 if mode == "transform-raise" and "planned transform bug" in str(e) else 1
    if mode == "transform-raise":
        print("ERROR rank %d planned although rank 1's transform raised" % rank, flush=True)
        return 1
    keys = sorted(it["key"] for it in global_plan[rank].items)
    if keys != sorted(["new_name"] + ["rep%d" % i for i in range(6)]):
        print("ERROR the plan has keys %s" % keys, flush=True)
        return 1
    for p in global_plan:
        for it in p.items:
            if it["key"].startswith("rep") and it["owners"] != [0]:
                print("ERROR %s is written by %s" % (it["key"], it["owners"]), flush=True)
                return 1
    ferry.save_on_this_process(global_plan[rank]).wait()
    path = ferry.barrier()
    print("rank %d of %d saved %s" % (rank, world, path), flush=True)
    return 0


def main():
    mode, root = sys.argv[1], sys.argv[2]
    rank, world = ferry.rank(), ferry.default_runtime().world_size
    assert rank == int(os.environ["RANK"])
    if mode.startswith("transform"):
        return transform_main(mode, root, rank, world)
    got = {}

    def checkpoint_fn(sd, filename):
        if mode == "raise" and rank == 1:
            raise ValueError("planned bug in the user's function")
        got.update({k: tuple(v.shape) for k, v in sd.items()})
        write_safetensors(sd, filename)

    if mode == "save-opts":  # the shape of DCP's example, with Ferry's file options
        options = ferry.CheckpointOptions(compress=True, shard_size=256)
        planner = ferry.SavePlanner(saved_state_dict(rank, world), "my_checkpoint", options,
                                    root=root)
    else:
        planner = ferry.SavePlanner(saved_state_dict(rank, world), "rank", root=root,
                                    checkpoint_fn=checkpoint_fn if mode != "save" else None)
    print("LOCAL %d %s" % (rank, planner.create_local_plan().to_bytes().hex()), flush=True)
    try:
        global_plan = planner.create_global_plan()
    except ferry.FerryError as e:
        # Rank 1's raise may abort the checkpoint before this rank saw its
        # plan: the same failure, one step earlier.
        print("rank %d failed: %s" % (rank, e), flush=True)
        return 0 if mode == "raise" and "planned bug" in str(e) else 1
    assert len(global_plan) == world and global_plan[rank].rank == rank
    if rank == 0:
        for p in global_plan:
            print("GLOBAL %d %s" % (p.rank, p.to_bytes().hex()), flush=True)
        print(str(global_plan[world - 1]), flush=True)
    mine = global_plan[rank]
    assert ferry.plan.SavePlan.from_bytes(mine.to_bytes()) == mine
    try:
        ferry.save_on_this_process(global_plan[(rank + 1) % world])
        print("ERROR another rank's plan was accepted", flush=True)
        return 1
    except ferry.FerryError as e:
        print("refused: %s" % e, flush=True)
    try:
        for r, plan in enumerate(global_plan):
            if r == ferry.rank():
                h = ferry.save_on_this_process(plan)
        h.wait()
        path = ferry.barrier()
    except ferry.FerryError as e:
        print("rank %d failed: %s" % (rank, e), flush=True)
        return 0 if mode == "raise" and "planned bug" in str(e) else 1
    if mode == "raise":
        print("ERROR committed although rank 1's function raised", flush=True)
        return 1
    if mode == "save-fn":
        want = {}
        for w in mine.writes:
            key = mine.items[w["item"]]["key"]
            want[key] = tuple(w["sizes"])
        names = {k.split("@")[0]: v for k, v in got.items()}
        if names != want or len(got) != len(mine.writes):
            print("ERROR checkpoint_fn got %s, the plan has %s" % (got, want), flush=True)
            return 1
        print("checkpoint_fn got the planned tensors", flush=True)
    print("rank %d of %d saved %s" % (rank, world, path), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
