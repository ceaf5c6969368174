#!/usr/bin/env python3
"""Train a small model with periodic asynchronous checkpoints, crash on
request, and resume bit for bit.

    python3 examples/train_resume.py --root /tmp/run --steps 300 --crash-at 170
    python3 examples/train_resume.py --root /tmp/run --steps 300   # resumes at 161

Everything that decides the next loss is in the checkpoint: the model, the
optimizer's state, both random generators (torch's global one, used by
dropout, and the data generator) and the step. So the losses after a resume
are bitwise the losses of a run that never stopped. --losses FILE appends
"step loss" lines (the loss as a float hex string, so equality is exact).
"""

import argparse
import os
import signal
import sys

import torch

import ferry


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.GELU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 1),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    return model, opt


def batch(gen, n=64):
    x = torch.randn(n, 32, generator=gen)
    y = (x[:, :4].sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(n, 1, generator=gen))
    return x, y


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="checkpoint directory")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--crash-at", type=int, default=None,
                    help="SIGKILL this process right after training this step")
    ap.add_argument("--losses", default=None, help="append 'step loss' lines here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    ferry.configure(pool_bytes="32MiB", chunk_bytes="1MiB")
    model, opt = build(args.seed)
    data = torch.Generator().manual_seed(args.seed + 1)
    state = {
        "model": model,
        "optim": opt,
        "rng": {"torch": torch.get_rng_state(), "data": data.get_state()},
        "step": 0,
    }
    out = open(args.losses, "a") if args.losses else None

    with ferry.CheckpointManager(args.root, save_interval_steps=args.save_every,
                                 keep_last=args.keep_last) as mgr:
        start = 0
        if mgr.latest_step() is not None:
            mgr.restore(state=state)  # model, optimizer, RNG tensors, step: in place
            torch.set_rng_state(state["rng"]["torch"])
            data.set_state(state["rng"]["data"])
            start = state["step"]
            print("resumed from step %d" % start, flush=True)
        for step in range(start + 1, args.steps + 1):
            x, y = batch(data)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if out:
                out.write("%d %s\n" % (step, loss.item().hex()))
                out.flush()
            if mgr.should_save(step):
                state["step"] = step
                state["rng"]["torch"] = torch.get_rng_state()
                state["rng"]["data"] = data.get_state()
                mgr.save(step, state)  # returns after the snapshot; commit goes on
            if step == args.crash_at:
                print("crashing at step %d" % step, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if step % 50 == 0:
                print("step %d loss %.5f" % (step, loss.item()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
