"""The example's silent-data-corruption scrubbing (rerun.scrub) and its ``sdc`` fault kinds.

``--scrub auto`` (default): a warm reserve re-computes every K-th step of one active rank
(rotating) whenever the run has a reserve; without one, nothing (``--scrub in-place`` re-computes
on the rank itself: transient faults only). DDP only: the check compares a rank's local
gradients, which FSDP/TP shard.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCRUB_MODES = ("auto", "reserve", "in-place", "off")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scrub",
        choices=SCRUB_MODES,
        default="auto",
        help="silent data corruption scrubbing (docs/rerun.md): reserve: a warm reserve\n"
        "re-computes every K-th step of one rank (rotating); in-place: each rank re-computes\n"
        "its own K-th steps (transient faults only); auto (default): reserve when the run\n"
        "has a reserve, else off",
    )
    p.add_argument(
        "--scrub-every", type=int, default=5, help="K: check every K-th step (default 5)"
    )
    p.add_argument(
        "--scrub-blocks",
        type=int,
        default=0,
        metavar="B",
        help="for benchmarks/sdc_scrub.py: scrub in the even blocks of B steps only (steps\n"
        "0..B-1, 2B..3B-1, ...), so that one run times its steps with and without checks\n"
        "(0, the default: every block)",
    )


def scrubbed(args: argparse.Namespace, step: int) -> bool:
    """Whether ``step`` takes part in scrubbing (``--scrub-blocks``); the same on every rank."""
    blocks = args.scrub_blocks
    return blocks <= 0 or (step // blocks) % 2 == 0


def mode(args: argparse.Namespace, *, world: int, active: int) -> str:
    """The scrubber's mode ('off', 'in_place', 'reserve'); ValueError for a bad combination."""
    if args.scrub_every < 1:
        raise ValueError(f"--scrub-every ({args.scrub_every}) must be >= 1: check every K-th step")
    chosen = args.scrub
    # The reserve's checks travel through the job's hosted TCPStore (store_factory); a job on
    # etcd (the launcher's --store: INPROCESS_STORE) has none.
    on_etcd = bool(os.environ.get("INPROCESS_STORE"))
    if chosen == "auto":
        chosen = "reserve" if world > active and args.parallel == "ddp" and not on_etcd else "off"
    if chosen == "reserve" and on_etcd:
        raise ValueError(
            "--scrub reserve sends its checks through the job's TCPStore, but this job's store "
            "is etcd (INPROCESS_STORE): use --scrub in-place, or --scrub off"
        )
    if chosen != "off" and args.parallel != "ddp":
        raise ValueError(
            f"--scrub {chosen} compares a rank's local gradients, which --parallel "
            f"{args.parallel} shards: use --parallel ddp, or --scrub off"
        )
    if chosen == "reserve" and world <= active:
        raise ValueError(
            f"--scrub reserve needs a warm reserve, but all {world} processes train (--active "
            f"{active}): start one more process, or use --scrub in-place"
        )
    return chosen.replace("-", "_")


def check_plan(plan: list[Any], args: argparse.Namespace) -> None:
    if any(f.kind.startswith("sdc") for f in plan) and args.parallel != "ddp":
        raise ValueError(
            f"kinds sdc/sdc-once corrupt a local DDP gradient: use --parallel ddp, not "
            f"{args.parallel}"
        )


def store_factory() -> Callable[[], Any]:
    """A new client of the job's store (MASTER_ADDR:MASTER_PORT) per call."""
    from restartable.inprocess.store_server import client

    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    return lambda: client(host, port, timeout=60.0)


class Corruption:
    """The ``sdc`` / ``sdc-once`` faults of this process, applied to a model's gradients."""

    def __init__(self, plan: list[Any], run_dir: Path) -> None:
        self._sdc_steps = {f.step for f in plan if f.kind == "sdc"}
        self._any = any(f.kind.startswith("sdc") for f in plan)
        self._run_dir = run_dir
        self.flip: Any = None

    def attach(self, model: Any) -> None:
        """At every model build (each train() call), before anything else hooks gradients."""
        if not self._any:
            return
        from restartable.inprocess.faults.sdc import GradientBitFlip, corrupting

        self.flip = GradientBitFlip()
        self.flip.attach(model)
        if self._sdc_steps and corrupting(self._run_dir):
            self.flip.arm_lasting()

    def fired(self, due: Any, step: int) -> None:
        """After ``faults.fire_planned`` at ``step`` (``due``: the numeric fault it returned)."""
        if self.flip is None:
            return
        from restartable.inprocess.faults.sdc import corrupting

        if due is not None and due.kind == "sdc-once":
            self.flip.arm_once()
        if step in self._sdc_steps and corrupting(self._run_dir):
            self.flip.arm_lasting()


def restore_into(state: Any) -> Callable[[Any], None]:
    """Load a copy of another rank's ``TrainState`` into ``state``, keeping this rank's own
    re-run machine (its key is per rank)."""

    def restore(sd: dict[str, Any]) -> None:
        own = {k: v for k, v in sd.items() if not k.startswith("rerun_rank")}
        own[state.rerun_key] = state.rsm.state_dict()
        state.load_state_dict(own)

    return restore
