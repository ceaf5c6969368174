"""One rank of a job started by `ferry launch` (tests/python/test_resume_checks.py):
`differ ROOT` saves a tensor under one key with a value of each rank's own
(the per-rank RNG state mistake): the save must fail naming the key;
`rank0-only ROOT` saves on rank 0 only (the `if rank == 0: torch.save`
habit): rank 0's save must fail saying the others never called save;
`pipeline-save ROOT` / `pipeline-load ROOT`: each rank is a pipeline stage
with layers of its own, same shapes, and an Adam optimizer whose torch ids
are 0 and 1 on both stages; each stage must load its own optimizer state."""

import os
import sys
import time

import torch

import ferry

mode, root = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
ferry.configure(pool_bytes="8MiB", chunk_bytes="256KiB", connect_timeout="3s")



class Stage(torch.nn.Module):
    """Pipeline stage `rank`: layers named after their place in the whole model."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(100 + rank)
        self.layers = torch.nn.ModuleDict({str(2 * rank + i): torch.nn.Linear(4, 4)
                                           for i in range(2)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def trained_stage(rank, steps):
    m = Stage(rank)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(7 + rank)
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(8, 4, generator=g)).pow(2).sum().backward()
        opt.step()
    return m, opt


if mode == "pipeline-save":
    m, opt = trained_stage(rank, 3)
    path = ferry.save({"model": m, "optim": opt}, root, 1)
    print("pipeline saved %s" % os.path.basename(path))
elif mode == "pipeline-load":
    want_m, want_opt = trained_stage(rank, 3)
    m = Stage(rank)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # other weights: the load must replace them
    opt = torch.optim.Adam(m.parameters(), lr=0.5)
    ferry.load({"model": m, "optim": opt}, root)
    got, want = opt.state_dict(), want_opt.state_dict()
    ok = got["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]
    ok = ok and sorted(got["state"]) == sorted(want["state"])
    for i, s in want["state"].items():
        for field, v in s.items():
            ok = ok and torch.equal(got["state"][i][field], v)
    for (n, p), (_, q) in zip(m.named_parameters(), want_m.named_parameters()):
        ok = ok and torch.equal(p, q)
    print("pipeline stage %d loaded its own optimizer state: %s" % (rank, "ok" if ok else "WRONG"))
elif mode == "differ":
    # Not a name Ferry takes for per-rank state (rng, *_rng_state): a replica.
    noise = torch.Generator().manual_seed(1234 + rank).get_state()
    try:
        ferry.save({"noise": noise, "w": torch.ones(4)}, root, 1)
        print("saved: wrong")
    except ferry.FerryError as e:
        print("refused: %s" % e)
elif mode == "rank0-only":
    marker = os.path.join(root, "rank0-done")
    if rank != 0:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        print("rank %d never saved" % rank)
    else:
        t0 = time.monotonic()
        try:
            ferry.save({"w": torch.ones(4)}, root, 5)
            print("saved: wrong")
        except ferry.FerryError as e:
            print("refused after %.1f s: %s" % (time.monotonic() - t0, e))
        open(marker, "w").close()
