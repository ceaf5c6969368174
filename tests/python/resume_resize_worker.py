"""One rank of a data-parallel training job started by `ferry launch`
(tests/python/test_resume_resize.py): a model, AdamW (saved by parameter
name), a StepLR scheduler, a per-rank torch.Generator (input noise), the
global CPU RNG state and a StatefulDataLoader-shaped position, gradients
summed over the ranks with gloo. Rank 0 writes the global loss of every
step it runs to OUT as JSON.

  full ROOT OUT TOTAL SAVE_AT   steps 0..TOTAL; after SAVE_AT steps, saves
                                with Ferry and hands the same state over with
                                torch.save (ROOT/handover-<rank>.pt)
  resume ROOT OUT TOTAL         fresh objects, ferry.load(ROOT), then the
                                remaining steps; per-rank state on_resize="first"
  handover ROOT OUT TOTAL       the same from the torch.save files, each rank
                                taking what "first" gives it (its own into the
                                same world size, else rank 0's): the run the
                                resume must match bit for bit
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import ferry

mode, root, out, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ferry.configure(pool_bytes="8MiB", chunk_bytes="256KiB", connect_timeout="10s")
dist.init_process_group("gloo", rank=rank, world_size=world)
torch.set_num_threads(1)

BATCH = 6  # global batch: split over 1, 2 or 3 ranks
data_gen = torch.Generator().manual_seed(7)
X = torch.randn(60, 8, generator=data_gen)
Y = torch.randn(60, 1, generator=data_gen)


class StatefulDataLoader:
    """Batches of the global dataset; this rank's rows of each. Its state
    (the batches consumed) is what torchdata's StatefulDataLoader keeps."""

    def __init__(self):
        self.batches = 0

    def next(self):
        start = (self.batches * BATCH) % len(X)
        lo, hi = ferry.split_range(BATCH, rank, world)
        self.batches += 1
        return X[start + lo:start + hi], Y[start + lo:start + hi]

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, sd):
        self.batches = sd["batches"]


def fresh(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    rng = torch.Generator().manual_seed(1000 + rank)
    return model, opt, sched, rng, StatefulDataLoader()


def step(model, opt, sched, rng, loader):
    x, y = loader.next()
    x = x + 0.1 * torch.randn(x.shape, generator=rng)  # per-rank augmentation
    # Sum over this rank's rows / global batch: the ranks' sum is the mean.
    loss = ((model(x) - y) ** 2).sum() / BATCH
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    sched.step()
    total_loss = loss.detach().clone()
    dist.all_reduce(total_loss)
    return total_loss.item()


def state_of(model, opt, sched, rng, loader, on_resize):
    return {"model": model, "optim": opt, "sched": sched,
            "rng": ferry.per_rank(rng, on_resize=on_resize),
            "cpu_rng_state": ferry.per_rank(torch.get_rng_state(), on_resize=on_resize),
            "data": ferry.per_rank(loader, on_resize=on_resize)}


losses = {}
if mode == "full":
    save_at = int(sys.argv[5])
    model, opt, sched, rng, loader = fresh(1)
    torch.manual_seed(50 + rank)
    for s in range(total):
        if s == save_at:
            ferry.save(state_of(model, opt, sched, rng, loader, "first"), root, s)
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                        "sched": sched.state_dict(), "rng": rng.get_state(),
                        "cpu_rng_state": torch.get_rng_state(), "data": loader.state_dict()},
                       os.path.join(root, "handover-%d.pt" % rank))
        losses[s] = step(model, opt, sched, rng, loader)
else:
    model, opt, sched, rng, loader = fresh(2)  # other values, which the load replaces
    if mode == "resume":
        st = state_of(model, opt, sched, rng, loader, "first")
        ferry.load(st, root)
        torch.set_rng_state(st["cpu_rng_state"].value)
    else:
        saved_world = len([f for f in os.listdir(root) if f.startswith("handover-")])
        own = torch.load(os.path.join(root, "handover-%d.pt" % (rank if saved_world == world
                                                                else 0)))
        r0 = torch.load(os.path.join(root, "handover-0.pt"))  # replicated state: any rank's
        model.load_state_dict(r0["model"])
        opt.load_state_dict(r0["optim"])
        sched.load_state_dict(r0["sched"])
        rng.set_state(own["rng"])
        torch.set_rng_state(own["cpu_rng_state"])
        loader.load_state_dict(own["data"])
    for s in range(loader.batches, total):
        losses[s] = step(model, opt, sched, rng, loader)
if rank == 0:
    with open(out, "w") as f:
        json.dump({str(k): v.hex() for k, v in losses.items()}, f)
print("rank %d ran %s: %d steps" % (rank, mode, len(losses)))
dist.destroy_process_group()
