"""Blocking time of a per-step local save for the example's tiny GPT, against its floors.

Run: ``python benchmarks/local_save.py [--saves 300] [--gap-ms 20] [--local-dir DIR]``. Prints
one JSON document. The state is the one ``examples/train.py`` saves at every step (GPT-like
model, AdamW with its state, the re-run machine, the step; 116 tensors, 1.6 MB), saved through
``CheckpointManager(local_every=1)`` with a pause before each save, as training has. Reported:
the median and 90th percentile of ``save()``, and the medians of its floors, measured in the same
rounds (each after the same pause) on the same state:

* ``copy_floor_s``: one ``torch._foreach_copy_`` of the state's tensors into reused tensors
  (the copy a save cannot avoid);
* ``walk_floor_s``: the example's ``state_dict()`` (torch's ``get_state_dict``, cached) plus the
  save's walk of the state, with a walk memo of its own as the tier has (the mappings of tensors
  unchanged since the last walk come from it: checkpoint.local.memo); what any save must look at.

The difference between the save and the two floors is the tier's own work per save (layout
check, header and the scalars' JSON, buffer choice, handing off to the background thread).

``--parts`` then times, in saves of their own (same pause), the parts of each save: the user's
``state_dict()``, the rest of the walk, splitting tensors from scalars, the layout check, the
scalars' JSON (encode, and the decode that is the snapshot), the header, the copy, and the rest
(buffer choice, bookkeeping, the manager's own work, handing off). Each part's function is
wrapped for those saves only (~0.3 us per call). ``parts.parts_s``: the median of each part;
``parts.parts_sum_s``: the median save, which per save is the sum of its parts.

``--parallel fsdp`` (or ``tp``) also measures, in the same invocation, the same model sharded by
examples/parallel.py on a one-rank mesh (gloo): its state is made of DTensors, whose local shards
the tier packs with their sharding metadata; ``stall_over_copy_floor`` is the ratio per state.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled
sys.path.insert(0, str(ROOT / "examples"))


def example_state(parallel: str | None = None) -> dict[str, Any]:
    """examples/train.py's checkpointed state after one optimizer step (`parallel`: sharded by
    examples/parallel.py on the current one-rank group)."""
    from gpt import GPTConfig, build_model
    from state import TrainState

    from restartable.rerun import RerunStateMachine

    model = build_model(GPTConfig(), seed=1234)
    if parallel is not None:
        from parallel import shard

        shard(model, parallel, world=1, device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    rsm = RerunStateMachine(
        mode="validate_results",
        check_for_nan_in_loss=True,
        check_for_spiky_loss=True,
        hardware_id="cpu-rank0",
    )
    return {"train": TrainState(model, opt, rsm, 0)}


@contextlib.contextmanager
def timing_parts(mgr: Any, state: dict[str, Any]) -> Iterator[dict[str, list[int]]]:
    """While open, each call of a save's parts adds its duration (ns) to the yielded lists; the
    wrapped functions are the real ones, restored on exit. Keys: ``save`` (the manager's), the
    parts, and ``state_dict`` (inside ``walk``: the walk's own time is walk - state_dict)."""
    from restartable.checkpoint.local import packing, walk
    from restartable.checkpoint.local import tier as tier_module

    times: dict[str, list[int]] = {}
    clock = time.perf_counter_ns

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                times.setdefault(key, []).append(clock() - t0)

        return call

    tier = mgr._local
    patches = [
        (mgr, "save", "save"),
        (tier._plans, "plan", "layout check"),
        (tier_module, "split_parts", "split"),
        (walk, "save_parts", "walk"),
        (packing, "compact", "scalars' JSON"),
        (packing, "header_bytes", "header"),
        (packing, "pack_into", "copy"),
    ]
    patches += [(obj, "state_dict", "state_dict") for obj in state.values()]
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in patches]
    real_json = tier_module.json
    try:
        for obj, name, key in patches:
            setattr(obj, name, timed(key, getattr(obj, name)))
        # The snapshot's decode: the tier's own json.loads only (a shim, not the json module).
        tier_module.json = types.SimpleNamespace(  # type: ignore[assignment]
            loads=timed("scalars' JSON", real_json.loads)
        )
        yield times
    finally:
        tier_module.json = real_json
        for obj, name, before in saved:
            if before is None:  # a method wrapped on the instance: the class's again
                delattr(obj, name)
            else:
                setattr(obj, name, before)


def measure_parts(
    state: dict[str, Any], n: int, gap: float, local_dir: str | None
) -> dict[str, Any]:
    """n saves, each after `gap` of sleep, with their parts timed (``timing_parts``): per-save
    medians of each part (seconds; the walk without the user's state_dict, and the rest of the
    save), and the median save they add up to."""
    with (
        tempfile.TemporaryDirectory(prefix="bench-local-save-") as tmp,
        _manager(tmp, local_dir) as mgr,
        timing_parts(mgr, state) as times,
    ):
        for step in range(1, n + 1):
            time.sleep(gap)
            mgr.save(step, state)
    skip = min(10, n // 10)  # warm-up, as in measure()
    per: dict[str, list[float]] = {}
    for key, ns in times.items():
        calls = len(ns) // n  # the JSON's two calls (encode, decode) add up within a save
        per[key] = [sum(ns[i * calls : (i + 1) * calls]) / 1e9 for i in range(skip, n)]
    per["walk"] = [w - d for w, d in zip(per["walk"], per["state_dict"], strict=True)]
    total = per.pop("save")
    per["rest"] = [t - sum(p[i] for p in per.values()) for i, t in enumerate(total)]
    return {
        "parts_s": {k: statistics.median(v) for k, v in per.items()},
        "parts_sum_s": statistics.median(total),
    }


def _manager(tmp: str, local_dir: str | None) -> Any:
    """A manager that saves only the local tier, at every step (persistent: never here)."""
    from restartable.checkpoint.manager import CheckpointManager

    return CheckpointManager(
        f"{tmp}/ckpt",
        persistent_every=10**9,
        local_every=1,
        local_dir=local_dir,
        replication_factor=1,
    )


def measure(state: dict[str, Any], n: int, gap: float, local_dir: str | None) -> dict[str, Any]:
    """n rounds of (copy floor, walk floor, save), each after `gap` of sleep: a save follows a
    training step, so caches are cold for all three alike (a hot timeit loop of the floors ran
    2.5-4x faster than the same work inside saves here)."""
    from restartable.checkpoint.local import walk
    from restartable.checkpoint.local.memo import WalkMemo

    tensors = [x.value for x in walk.leaves(state, []) if isinstance(x.value, torch.Tensor)]
    views = [torch.empty_like(t) for t in tensors]
    memo = WalkMemo()
    times: dict[str, list[float]] = {"copy": [], "walk": [], "save": []}

    def timed(key: str, fn: Any) -> None:
        time.sleep(gap)
        t0 = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - t0)

    with (
        tempfile.TemporaryDirectory(prefix="bench-local-save-") as tmp,
        _manager(tmp, local_dir) as mgr,
    ):
        for step in range(1, n + 1):
            timed("copy", lambda: torch._foreach_copy_(views, tensors))
            timed("walk", lambda: walk.save_parts(state, [], memo))
            timed("save", lambda: mgr.save(step, state))  # noqa: B023 (called at once)
    skip = min(10, n // 10)  # warm-up: buffers allocated and faulted in the first saves
    med = {k: statistics.median(v[skip:]) for k, v in times.items()}
    return {
        "tensors": len(tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "saves": n - skip,
        "copy_floor_s": med["copy"],
        "walk_floor_s": med["walk"],
        "save_median_s": med["save"],
        "save_p90_s": statistics.quantiles(times["save"][skip:], n=10)[-1],
        "tier_own_work_s": med["save"] - med["copy"] - med["walk"],
        "stall_over_copy_floor": round(med["save"] / med["copy"], 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--saves", type=int, default=300)
    p.add_argument("--gap-ms", type=float, default=20.0, help="pause between saves (a step)")
    p.add_argument("--local-dir", default=None, help="node-local directory (default: memory)")
    p.add_argument("--parallel", choices=("fsdp", "tp"), help="also a sharded state (DTensors)")
    p.add_argument("--parts", action="store_true", help="also time the parts of each save")
    args = p.parse_args()
    torch.set_num_threads(1)  # as in examples/train.py
    state = example_state()
    result = {"benchmark": "local_save", **measure(state, args.saves, args.gap_ms / 1000,
                                                   args.local_dir)}  # fmt: skip
    if args.parts:
        result["parts"] = measure_parts(state, args.saves, args.gap_ms / 1000, args.local_dir)
    if args.parallel:
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        sharded = example_state(args.parallel)
        result[args.parallel] = measure(sharded, args.saves, args.gap_ms / 1000, args.local_dir)
        dist.destroy_process_group()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
