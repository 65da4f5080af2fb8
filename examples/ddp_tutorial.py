"""pytorch/examples' DDP tutorial (distributed/ddp-tutorial-series/multigpu_torchrun.py) ported
with @restartable as docs/inprocess.md#porting-a-torchrun-script says, on CPU/gloo.

    python -m restartable.launch --nproc-per-node 3 examples/ddp_tutorial.py 10 1 --kill-at 16

2 ranks train, 1 waits as a warm reserve. --kill-at STEP: rank 0's process SIGKILLs itself once
at STEP; the reserve takes its place and restores its state from the node-local copy.
"""

import argparse
import os
import signal
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from restartable.checkpoint import CheckpointManager
from restartable.inprocess import context, restartable

p = argparse.ArgumentParser()
p.add_argument("total_epochs", type=int)
p.add_argument("save_every", type=int)
p.add_argument("--batch_size", type=int, default=32)
p.add_argument("--kill-at", type=int, default=None)  # rank 0 SIGKILLs itself once at this step
p.add_argument("--ckpt", default="runs/ddp_tutorial")
args = p.parse_args()

# The tutorial's snapshot.pt becomes the manager: every step in memory and in a node-local
# directory (a killed rank's copy survives it there), every 50 steps on the persistent tier.
mgr = CheckpointManager(
    args.ckpt, local_every=1, local_dir=os.path.join(args.ckpt, "local"), persistent_every=50
)


class MyTrainDataset(Dataset):  # the tutorial's datautils.MyTrainDataset
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)  # the same data on every rank
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: DataLoader, save_every: int) -> None:
        self.train_data = train_data
        self.model = DDP(model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.save_every = save_every
        self.first = True
        self.state = {"model": self.model, "opt": self.optimizer}
        self.step = mgr.load_latest(self.state) or 0  # the tutorial's _load_snapshot

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = (self.model(source) - targets).pow(2).mean()  # the tutorial: cross_entropy
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def train(self, max_epochs: int) -> float:
        per_epoch = len(self.train_data)
        loss = 0.0
        for epoch in range(self.step // per_epoch, max_epochs):
            self.train_data.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            for i, (source, targets) in enumerate(self.train_data):
                if epoch * per_epoch + i < self.step:
                    continue  # done before the restart
                loss = self._run_batch(source, targets)
                self.step += 1
                context().ping(self.step)  # progress, for the restart line and the report
                if self.first and args.kill_at is not None and context().rank == 0:
                    print(f"FIRST_STEP {context().iteration} {time.time():.6f}", flush=True)
                self.first = False
                if self.step == args.kill_at and context().iteration == 0 and context().rank == 0:
                    print(f"KILL {time.time():.6f}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.step % self.save_every == 0:
                    mgr.save(self.step, self.state)
        return loss


@restartable(soft_timeout=10.0, hard_timeout=20.0, active_world_size=2)
def train() -> float:
    torch.manual_seed(0)
    dataset = MyTrainDataset(2048)
    loader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=False, sampler=DistributedSampler(dataset)
    )
    trainer = Trainer(torch.nn.Linear(20, 1), loader, args.save_every)
    return trainer.train(args.total_epochs)


loss = train()
mgr.close()
if loss is not None and os.environ["RANK"] == "0":
    print(f"done: loss {loss:.4f}", flush=True)
