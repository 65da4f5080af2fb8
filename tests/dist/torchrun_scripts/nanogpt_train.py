"""
karpathy/nanoGPT train.py's shape, shrunk to a tiny model on random tokens, on CPU (gloo): all
module-level code, its own init_process_group / destroy_process_group, RANK / LOCAL_RANK /
WORLD_SIZE from the environment, and its ckpt.pt in out_dir to resume from. Run:
$ torchrun --standalone --nproc_per_node=2 nanogpt_train.py --max_iters=20
"""

import os
import sys

import torch
from faultpoint import maybe_fault
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
# default config values
out_dir = "out"
eval_interval = 4  # checkpoint every this many iterations
max_iters = 20
block_size = 8
vocab_size = 32
n_embd = 16
learning_rate = 1e-2
backend = "gloo"  # 'nccl', 'gloo', etc.
init_from = "scratch"  # 'scratch' or 'resume'
fault = ""  # raise, hang or kill (faultpoint.py), once, at fault_iter on RANK fault_rank
fault_iter = 6
fault_rank = 1
# -----------------------------------------------------------------------------
for arg in sys.argv[1:]:  # nanoGPT's configurator.py: --key=value overrides
    key, val = arg[2:].split("=")
    globals()[key] = type(globals()[key])(val)
# -----------------------------------------------------------------------------

ddp = int(os.environ.get("RANK", -1)) != -1  # is this a ddp run?
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0  # this process will do logging, checkpointing etc.
    seed_offset = ddp_rank  # each process gets a different seed
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
print(
    f"start pid {os.getpid()} RANK {os.environ.get('RANK')} restart "
    f"{os.environ.get('TORCHELASTIC_RESTART_COUNT')}"
)
os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)


def get_batch(it):
    g = torch.Generator().manual_seed(1000 * it + seed_offset)
    x = torch.randint(vocab_size, (4, block_size), generator=g)
    return x, torch.roll(x, 1, dims=1)


model = torch.nn.Sequential(
    torch.nn.Embedding(vocab_size, n_embd), torch.nn.Linear(n_embd, vocab_size)
)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
iter_num = 0
ckpt_path = os.path.join(out_dir, "ckpt.pt")
if init_from == "resume" or os.path.exists(ckpt_path):  # resume from a checkpoint
    print(f"Resuming training from {out_dir}")
    checkpoint = torch.load(ckpt_path, map_location="cpu")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num = checkpoint["iter_num"]
    checkpoint = None  # free up memory
if ddp:
    model = DDP(model)
raw_model = model.module if ddp else model

X, Y = get_batch(iter_num)  # fetch the very first batch
while True:
    if iter_num % eval_interval == 0 and master_process and iter_num > 0:
        checkpoint = {
            "model": raw_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "iter_num": iter_num,
        }
        print(f"saving checkpoint to {out_dir}")
        torch.save(checkpoint, ckpt_path)
    maybe_fault(fault, fault_iter, fault_rank, ckpt_path + ".fault", step=iter_num)
    logits = model(X)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab_size), Y.view(-1))
    X, Y = get_batch(iter_num + 1)  # async prefetch the next batch in nanoGPT
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if master_process:
        print(f"iter {iter_num}: loss {loss.item():.4f}")
    iter_num += 1
    if iter_num > max_iters:
        break

if ddp:
    destroy_process_group()
print(f"done RANK {os.environ.get('RANK')} pid {os.getpid()} iter {iter_num}")
