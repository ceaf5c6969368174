"""One rank of a job started by `ferry launch` (tests/python/test_per_rank.py).

`save ROOT`: each rank saves its own RNG states (a torch.Generator, the
global CPU RNG state under a key named *_rng_state), a data loader's
position (a StatefulDataLoader-shaped object), a ferry.per_rank int and a
replicated tensor.
`load ROOT POLICY`: a fresh state dict loads it. POLICY "auto": no
ferry.per_rank wrappers (Ferry recognises them); "error", "first", "fn":
every per-rank entry wrapped with that on_resize. Prints what each rank got
as "rank R got rank S's values" (or "refused: ...")."""

import os
import sys

import torch

import ferry

mode, root = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ferry.configure(pool_bytes="8MiB", chunk_bytes="256KiB", connect_timeout="10s")


class StatefulDataLoader:
    """The shape of torchdata's StatefulDataLoader: state_dict() and
    load_state_dict() of its iterator position."""

    def __init__(self):
        self.pos, self.epoch, self.order = 0, 0, ()

    def state_dict(self):
        return {"pos": self.pos, "epoch": self.epoch, "order": self.order}

    def load_state_dict(self, sd):
        self.pos, self.epoch, self.order = sd["pos"], sd["epoch"], sd["order"]


def values_of(r):
    """What rank r saved: (generator state, cpu rng state, loader state, int)."""
    g = torch.Generator().manual_seed(1000 + r)
    torch.randn(3 + r, generator=g)
    torch.manual_seed(50 + r)
    return (g.get_state(), torch.get_rng_state(),
            {"pos": 10 * r + 3, "epoch": 1, "order": (r, "x")}, 100 + r)


if mode == "save":
    gs, cpu, loader_sd, n = values_of(rank)
    g = torch.Generator()
    g.set_state(gs)
    loader = StatefulDataLoader()
    loader.load_state_dict(loader_sd)
    state = {"rng": g, "cpu_rng_state": cpu, "data": loader,
             "pos": ferry.per_rank(n), "w": torch.ones(4)}
    path = ferry.save(state, root, 1)
    print("rank %d saved %s" % (rank, path))
    sys.exit(0)

policy = sys.argv[3]


def fn(values, r, w):
    # The callable policy: the saved value of rank (r % saved ranks)...
    return values[r % len(values)]


def fn_sum(values, r, w):
    # ... and for "pos" the saved ints summed (a global counter), plus r.
    return sum(values) + r


g, cpu, loader = torch.Generator(), torch.zeros_like(torch.get_rng_state()), StatefulDataLoader()
if policy == "auto":
    state = {"rng": g, "cpu_rng_state": cpu, "data": loader, "pos": ferry.per_rank(0),
             "w": torch.zeros(4)}
else:
    p = fn if policy == "fn" else policy
    state = {"rng": ferry.per_rank(g, on_resize=p), "cpu_rng_state": ferry.per_rank(cpu, p),
             "data": ferry.per_rank(loader, p),
             "pos": ferry.per_rank(0, fn_sum if policy == "fn" else p), "w": torch.zeros(4)}
try:
    res = ferry.load(state, root)
except ferry.FerryError as e:
    print("rank %d refused: %s" % (rank, e))
    sys.exit(0)
got = (g.get_state(), cpu, loader.state_dict(), state["pos"].value)
ok = torch.equal(state["w"], torch.ones(4)) and not res.unexpected_keys
for r in range(4):
    want = values_of(r)
    if policy == "fn" and world != 2:
        want = want[:3] + (100 + 101 + rank,)  # fn's sum of the saved ints, plus the rank
    same = (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            and got[2] == want[2] and type(got[2]["order"]) is tuple and got[3] == want[3])
    if same:
        print("rank %d got rank %d's values%s" % (rank, r, "" if ok else " but w or keys WRONG %s"
                                                  % (res.unexpected_keys,)))
        break
else:
    print("rank %d got WRONG values: %r" % (rank, got[2:]))
