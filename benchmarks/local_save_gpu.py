"""The local tier's per-step save of CUDA state, against the device-to-host copy and the step.

Run: ``python benchmarks/local_save_gpu.py [--sizes 256x8 2048x16 4096x24] [--saves 20]``
(needs one CUDA device). Prints one JSON document. For each size ``WIDTHxLAYERS`` the state is
an MLP of that many ``Linear(WIDTH, WIDTH)`` layers on the GPU with its AdamW state (fp32; the
same dicts at every save, as a cached ``get_state_dict`` gives them), saved into host memory by
``LocalTier`` (memory only, one rank). Each round, medians over ``--saves`` rounds after 5 of
warm-up:

* ``step_ms``: one training step (forward, backward, AdamW), synchronized;
* ``step_with_save_ms``: a step, then ``save()``, then a synchronize: what a step that saves
  costs the job;
* ``save_ms``: the ``save()`` call alone, issued right after the step's kernels were queued. It
  synchronizes the device before it returns (the copy must be complete), so it also waits for
  the step's queued work;
* ``d2h_floor_ms``: one ``torch._foreach_copy_`` of the same tensors into pinned host tensors,
  synchronized: the copy no save can avoid while the copy is made on the training thread's
  stream, and ``d2h_gib_s`` its bandwidth.

The ratio ``step_with_save_over_step`` is the per-step local save's price on that GPU.

Then the overlapped path (``LocalConfig(overlap_copy=True)``, checkpoint/local/overlap.py), in
blocks of ``--saves`` steps alternating with plain blocks: ``overlapped_step_ms`` (a step that
saves, the copy running behind the next forward and backward), ``overlapped_over_step`` (target
<= 1.05 when the copy is shorter than the step), ``overlapped_over_max_step_copy`` (when the copy
is longer: the step is at best the copy), and ``restore_from_memory_ms``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(width: int, layers: int, saves: int, batch: int) -> dict[str, Any]:
    """The figures of one size (see the module docstring)."""
    from restartable.checkpoint.group import BackgroundGroup
    from restartable.checkpoint.local import LocalTier

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    for _ in range(3):  # AdamW's state exists from the first step on
        step()
    state: dict[str, Any] = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
    optim_tensors = [v for s in state["optim"]["state"].values() for v in s.values()]
    tensors = [*state["model"].values(), *optim_tensors]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    times: dict[str, list[float]] = {"step": [], "step_with_save": [], "save": [], "d2h": []}
    sync = torch.cuda.synchronize
    # The manager's own group source: not distributed here, so no group (one rank).
    group = BackgroundGroup(timeout=600.0, name="local")
    with LocalTier(
        local_dir=None, replication_factor=1, algo="atomic", keep=1, group=group
    ) as tier:
        for i in range(saves + 5):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times["step"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            state["step"] = i
            tier.save(i, state)
            t2 = time.perf_counter()
            sync()
            times["step_with_save"].append(time.perf_counter() - t0)
            times["save"].append(t2 - t1)
            t0 = time.perf_counter()
            torch._foreach_copy_(pinned, tensors, non_blocking=True)
            sync()
            times["d2h"].append(time.perf_counter() - t0)
    overlapped = measure_overlapped(step, state, saves, group)
    group.close()
    med = {k: statistics.median(v[5:]) * 1e3 for k, v in times.items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return {
        "width": width,
        "layers": layers,
        "tensors": len(tensors),
        "bytes": nbytes,
        "step_ms": round(med["step"], 3),
        "step_with_save_ms": round(med["step_with_save"], 3),
        "save_ms": round(med["save"], 3),
        "d2h_floor_ms": round(med["d2h"], 3),
        "d2h_gib_s": round(nbytes / 2**30 / (med["d2h"] / 1e3), 1),
        "step_with_save_over_step": round(med["step_with_save"] / med["step"], 2),
        # The overlapped path (LocalConfig(overlap_copy=True)): a step that saves, against
        # max(step, copy), the best a copy behind the step can do.
        **overlapped,
        "overlapped_over_step": round(overlapped["overlapped_step_ms"] / med["step"], 3),
        "overlapped_over_max_step_copy": round(
            overlapped["overlapped_step_ms"] / max(med["step"], med["d2h"]), 3
        ),
    }


def measure_overlapped(
    step: Callable[[], None], state: dict[str, Any], saves: int, group: Any
) -> dict[str, float]:
    """Blocks of `saves` steps, each followed by an overlapped save (the next step's optimizer
    waits for its copy), against blocks of plain steps, alternating, one synchronize per block;
    then the restore of the newest step from memory."""
    from restartable.checkpoint.local import LocalTier

    sync = torch.cuda.synchronize
    blocks: dict[str, list[float]] = {"plain": [], "overlapped": [], "restore": []}
    with LocalTier(
        local_dir=None, replication_factor=1, algo="atomic", keep=1, group=group, overlap=True
    ) as tier:
        for block in range(6):
            for name in ("plain", "overlapped"):
                sync()
                t0 = time.perf_counter()
                for i in range(saves):
                    step()
                    if name == "overlapped":
                        state["step"] = block * saves + i
                        tier.save(block * saves + i, state)
                sync()
                blocks[name].append((time.perf_counter() - t0) / saves)
            tier.wait()
            sync()
            t0 = time.perf_counter()
            tier.load(state, min_step=None)
            sync()
            blocks["restore"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) * 1e3 for k, v in blocks.items()}
    return {
        "overlapped_plain_step_ms": round(med["plain"], 3),
        "overlapped_step_ms": round(med["overlapped"], 3),
        "restore_from_memory_ms": round(med["restore"], 3),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["256x8", "2048x16", "4096x24"])
    p.add_argument("--saves", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("local_save_gpu.py needs a CUDA device; none is visible here", file=sys.stderr)
        return 2
    sizes = []
    for size in args.sizes:
        width, _, layers = size.partition("x")
        if not (width.isdigit() and layers.isdigit()):
            p.error(f"--sizes: {size!r} is not WIDTHxLAYERS (e.g. 2048x16)")
        sizes.append((int(width), int(layers)))
    doc = {
        "benchmark": "local_save_gpu",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "sizes": [measure(w, n, args.saves, args.batch) for w, n in sizes],
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
