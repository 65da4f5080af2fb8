"""The smallest @restartable DDP job: 2 ranks train, 1 waits as a warm reserve.

    python -m restartable.launch --nproc-per-node 3 examples/minimal.py --fail-at 30

--fail-at STEP: rank 1 raises once at STEP; every rank restarts in place and resumes.
Run again, the same command resumes an unfinished run and says when there is nothing left to do;
--ckpt NEW_DIR starts over.
"""

import argparse
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from restartable.checkpoint import CheckpointManager, PerRank
from restartable.inprocess import context, restartable

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--fail-at", type=int, default=None)  # inject one exception on rank 1
p.add_argument("--ckpt", default="runs/minimal")
args = p.parse_args()

# Outside train(): the manager outlives restarts (its host-memory copy is the fast tier).
mgr = CheckpointManager(args.ckpt, local_every=1, persistent_every=20)


@restartable(soft_timeout=10.0, hard_timeout=20.0, active_world_size=2)
def train() -> float | None:
    ctx = context()  # this iteration: ctx.rank, ctx.world_size, ctx.iteration
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(torch.nn.Linear(16, 1))  # inside train(): on this iteration's group
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # The state: the DDP module and the optimizer themselves (restored in place), and what
    # differs between ranks under PerRank.
    state = {"model": model, "opt": opt, "own": PerRank(rng=torch.get_rng_state())}
    start = mgr.load_latest(state) or 0  # the step of the newest save; 0: nothing saved
    torch.set_rng_state(state["own"]["rng"])
    if start >= args.steps:  # the same command after the run finished: the loop would not run
        if ctx.rank == 0:
            print(f"{args.ckpt} holds a finished {start}-step run: nothing to do", end="")
            print(" (--ckpt NEW_DIR starts a new run)")
        return None
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(32, 16)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()  # learn a sum
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == args.fail_at and ctx.iteration == 0 and ctx.rank == 1:  # once, not per restart
            raise RuntimeError(f"injected fault at step {step}")
        state["own"]["rng"] = torch.get_rng_state()
        mgr.save(step, state)  # after step's update: a restart resumes at step + 1
    return loss.item()


loss = train()  # train()'s value on the ranks that trained; None on the reserve or when finished
mgr.close()
if loss is not None and os.environ["RANK"] == "0":  # RANK: this rank in the last iteration
    print(f"done: loss {loss:.4f}")
