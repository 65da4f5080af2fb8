"""PyTorch Lightning integration: ``trainer.save_checkpoint`` and ``ModelCheckpoint`` go through a
``CheckpointManager`` (local tier every N steps, persistent torch_dist every M), and
``fit(ckpt_path="last")`` restores from the fastest tier that has the newest step.

    mgr = CheckpointManager("ckpts/", persistent_every=50, local_every=1, local_dir="/dev/shm/x")
    trainer = L.Trainer(..., callbacks=[TieredCheckpoint(mgr),
                                        ModelCheckpoint(dirpath="ckpts/ptl", every_n_train_steps=1,
                                                        save_last=True)])
    trainer.fit(model, ckpt_path="last")

Needs the ``lightning`` extra (``pip install -e ".[lightning]"``). See docs/lightning.md.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
except ImportError as exc:  # an optional extra: say how to get it
    raise ImportError(
        f'{__name__} needs PyTorch Lightning ({exc}): pip install -e ".[lightning]"'
    ) from exc

from restartable.checkpoint.errors import CheckpointConfigError, CheckpointError
from restartable.checkpoint.manager import CheckpointManager
from restartable.checkpoint.private_files import replace_private

log = logging.getLogger(__name__)

# What a pointer file written at a Lightning checkpoint path says: the data lives in the manager.
POINTER_FORMAT = "restartable-tiered-checkpoint"
_POINTER_MAX_BYTES = 4096  # a pointer is a small JSON object; anything larger is a real .ckpt


def read_pointer(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The pointer written at ``path`` by ``TieredCheckpointIO``, or None for any other file."""
    p = Path(path)
    try:
        if p.stat().st_size > _POINTER_MAX_BYTES:
            return None
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == POINTER_FORMAT else None


class TieredCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` whose checkpoints live in a ``CheckpointManager``.

    Lightning calls ``save_checkpoint`` on global rank 0 only (DDP); the collective
    ``manager.save`` therefore runs in ``TieredCheckpoint.on_save_checkpoint`` on every rank,
    and this method only writes a small JSON pointer at ``path`` (so that ``ModelCheckpoint``'s
    files, ``last.ckpt`` and ``ckpt_path="last"`` keep working). ``load_checkpoint`` is called
    on every rank (COLLECTIVE): a pointer resolves to the newest step that every rank can obtain,
    from the fastest tier (memory, node-local directory, peer, persistent); a regular Lightning
    ``.ckpt`` file is read with ``torch.load`` as Lightning would. Use it through
    ``TieredCheckpoint``, which installs it and gives it the module it restores into.
    """

    def __init__(self, manager: CheckpointManager) -> None:
        if not isinstance(manager, CheckpointManager):
            raise CheckpointConfigError(
                f"manager ({type(manager).__name__}) must be a CheckpointManager: "
                "create one outside train(), e.g. CheckpointManager('ckpts/', persistent_every=50,"
                " local_every=1)"
            )
        self.manager = manager
        self.module: torch.nn.Module | None = None  # set by TieredCheckpoint.setup
        self._fallback = TorchCheckpointIO()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Write the pointer for ``checkpoint["global_step"]`` at ``path`` (atomically)."""
        step = int(checkpoint.get("global_step", 0))
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        body = {"format": POINTER_FORMAT, "step": step, "root": self.manager.root}
        replace_private(p, (json.dumps(body) + "\n").encode())

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """COLLECTIVE for a pointer: restore the newest step of any tier (see the class)."""
        pointer = read_pointer(path)
        if pointer is None:
            return dict(self._fallback.load_checkpoint(path, map_location, weights_only))
        if self.module is None:
            raise CheckpointConfigError(
                "TieredCheckpointIO.load_checkpoint was called before TieredCheckpoint.setup: "
                "add TieredCheckpoint(manager) to the Trainer's callbacks instead of passing the "
                "IO as a plugin"
            )
        # The module's own tensors are the template: the tiers copy the weights straight into
        # them (and DCP can reshard them); the rest of Lightning's checkpoint is one object.
        state: dict[str, Any] = {"state_dict": self.module.state_dict(), "lightning": b""}
        step = self.manager.load_latest(state)
        if step is None:
            raise CheckpointError(
                f"{path} names step {pointer.get('step')} of {pointer.get('root')}, but no tier "
                "holds a checkpoint: the run's checkpoints were removed; delete the pointer to "
                "start fresh"
            )
        if step != pointer.get("step"):
            log.warning(
                "checkpoint: %s names step %s; the newest step every rank can restore is %d "
                "(from the %s tier): resuming there",
                path,
                pointer.get("step"),
                step,
                self.manager.last_restore.tier if self.manager.last_restore else "?",
            )
        ckpt = _load_lightning_part(state["lightning"], weights_only=weights_only)
        ckpt["state_dict"] = state["state_dict"]
        return dict(ckpt)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer only: the manager's own retention (``keep``) prunes the data."""
        if read_pointer(path) is None:
            self._fallback.remove_checkpoint(path)
        else:
            Path(path).unlink(missing_ok=True)

    def teardown(self) -> None:
        """Nothing to free: the manager outlives the Trainer (close it yourself)."""


class TieredCheckpoint(pl.Callback):
    """Make every Lightning checkpoint a ``CheckpointManager`` save; restore from its tiers.

    Add it to the Trainer's callbacks with the manager (created once, outside ``train()``).
    At ``setup`` it installs a ``TieredCheckpointIO`` as the strategy's checkpoint IO. Each
    ``trainer.save_checkpoint`` (``ModelCheckpoint``'s included) then calls ``manager.save`` on
    every rank at the same point (``on_save_checkpoint``; one save per ``global_step``, so
    ``last.ckpt`` and the top-k file of the same step cost one save), and the manager picks the
    tiers by step (``local_every``, ``persistent_every``). The model's weights are saved as
    tensors (staged by one copy; ``dcp.load`` reads them as ``state_dict.<name>``); the rest
    of Lightning's checkpoint (optimizer and loop states, callbacks, hyper-parameters) travels
    as one pickled object. At the end of ``fit`` it waits for the saves in flight.
    """

    def __init__(self, manager: CheckpointManager) -> None:
        self.io = TieredCheckpointIO(manager)
        self.manager = manager
        self._last_step: int | None = None
        # Set by inprocess.lightning.FaultToleranceCallback: opens its "checkpointing" section.
        self.save_section: Callable[[str], AbstractContextManager[Any]] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Install the IO (before Lightning restores a checkpoint) and bind the module."""
        trainer.strategy.checkpoint_io = self.io
        self.io.module = pl_module
        self._last_step = None

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """COLLECTIVE: every rank reaches this hook in ``trainer.save_checkpoint``."""
        step = int(checkpoint["global_step"])
        if step == self._last_step:
            return  # ModelCheckpoint saves last.ckpt and the top-k file at the same step
        rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        buf = io.BytesIO()
        torch.save(rest, buf)
        state = {"state_dict": checkpoint["state_dict"], "lightning": buf.getvalue()}
        section = self.save_section("checkpointing") if self.save_section else nullcontext()
        with section:
            self.manager.save(step, state)
        self._last_step = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The last save must land before the processes exit."""
        self.manager.wait()


def _load_lightning_part(data: bytes, *, weights_only: bool | None) -> dict[str, Any]:
    """Lightning's part of a checkpoint (loops, callbacks, optimizer states, hyper-parameters),
    read with ``torch.load(weights_only=True)``: a checkpoint file is input and runs no code.
    Only a caller that asks for ``weights_only=False`` itself (``Trainer.fit(...,
    weights_only=False)``, for hyper-parameters of its own classes) gets the full unpickler."""
    from restartable.checkpoint.local.header_objects import numpy_globals, short_reason

    try:
        with torch.serialization.safe_globals(numpy_globals()):
            return dict(
                torch.load(
                    io.BytesIO(data), map_location="cpu", weights_only=weights_only is not False
                )
            )
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"the Lightning part of the checkpoint holds objects that are not plain data "
            f"({short_reason(exc)}): refused unread. If you wrote it yourself and trust it, pass "
            "weights_only=False to Trainer.fit, or allowlist the class with "
            "torch.serialization.add_safe_globals"
        ) from exc
