"""PyTorch Lightning integration: ``StragglerDetectionCallback`` drives a ``straggler.Detector``
from the Trainer's batch hooks (the seeds' parameter names), and with ``stop_if_detected`` saves
a checkpoint and sets ``trainer.should_stop`` on every rank at the same step.

Needs the ``lightning`` extra (``pip install -e ".[lightning]"``). See docs/lightning.md.
"""

from __future__ import annotations

import logging
import os
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError as exc:  # an optional extra: say how to get it
    raise ImportError(
        f'{__name__} needs PyTorch Lightning ({exc}): pip install -e ".[lightning]"'
    ) from exc

import torch.distributed as dist

from restartable.straggler._torch_private import default_store
from restartable.straggler.config import DetectorConfig
from restartable.straggler.detector import Detector
from restartable.straggler.errors import ConfigError
from restartable.straggler.report import Report

log = logging.getLogger(__name__)

# NVIDIA's StragglerDetectionCallback calls it num_gpu_perf_scores_to_log; the config (and
# NeMo's recipe) num_gpu_perf_scores_to_print. Both mean the same: accepted, one at a time.
_ALIASES = {"num_gpu_perf_scores_to_log": "num_gpu_perf_scores_to_print"}


class StragglerDetectionCallback(pl.Callback):
    """Report (and optionally stop on) slow ranks of a Lightning run.

    Keyword arguments are ``DetectorConfig``'s fields (NVIDIA's names and defaults:
    ``report_time_interval``, ``calc_relative_gpu_perf``, ``calc_individual_gpu_perf``,
    ``num_gpu_perf_scores_to_print`` or its alias ``num_gpu_perf_scores_to_log``,
    ``gpu_relative_perf_threshold``, ``gpu_individual_perf_threshold``, ``stop_if_detected``,
    ...), validated here. ``logger_name`` names the logger of the reports (default
    ``straggler.detector``'s records plus one line on this module's logger per straggler).
    ``context``: the restart context (``inprocess.context()``) when ``fit`` runs under
    ``@restartable``; otherwise the detector uses the job's default process group's store.

    Each training batch is one ``"step"`` section (``on_train_batch_start`` ->
    ``on_train_batch_end``), timed by the rank's own compute (CPU time, or CUDA events); every
    rank calls ``report_if_due(global_step)`` at the end of every batch. When a report says
    stop, every rank saves a checkpoint (``trainer.save_checkpoint`` to the first
    ``ModelCheckpoint``'s ``last.ckpt``, else ``default_root_dir/straggler-stop.ckpt``) and
    then sets ``trainer.should_stop``: Lightning ends ``fit`` after that batch, on every rank.
    ``reports`` keeps every report of this fit.
    """

    def __init__(
        self, *, context: Any = None, logger_name: str | None = None, **options: Any
    ) -> None:
        for alias, name in _ALIASES.items():
            if alias in options:
                if name in options:
                    raise ConfigError(
                        f"{alias} ({options[alias]!r}) and {name} ({options[name]!r}) are the same"
                        f" option: pass only {name}"
                    )
                options[name] = options.pop(alias)
        if logger_name is not None and (not isinstance(logger_name, str) or not logger_name):
            raise ConfigError(
                f"logger_name ({logger_name!r}) must be a non-empty string or None: pass a "
                "logger name such as 'nemo_logger.StragglerDetectionCallback'"
            )
        try:
            self.config = DetectorConfig(**options)
        except TypeError as exc:
            raise ConfigError(
                f"StragglerDetectionCallback: {exc}: the options are DetectorConfig's fields "
                "(see docs/straggler.md#options)"
            ) from None
        self.context = context
        self.logger = logging.getLogger(logger_name) if logger_name else log
        self.reports: list[Report] = []
        self.detector: Detector | None = None
        self._section: Any = None
        self.stopped_fit = False  # this callback ended the fit (the FT callback reads it)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Build the detector for this fit (its ranks, its store)."""
        if stage != "fit":
            return
        self.reports = []
        self.stopped_fit = False
        if self.context is not None:
            self.detector = Detector(self.config, context=self.context)
            return
        world = trainer.world_size
        store = None
        if world > 1:
            if not dist.is_initialized():
                raise ConfigError(
                    f"StragglerDetectionCallback: world_size {world} but no process group at "
                    "setup: use a distributed strategy (e.g. strategy='ddp'), or pass context="
                )
            # The job's store (Lightning's, or @restartable's group's): scores never travel
            # through the training group. A prefix keeps our keys apart from torch's.
            store = dist.PrefixStore("straggler/", default_store())
        self.detector = Detector(
            self.config, store=store, rank=trainer.global_rank, world_size=world
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Open the ``step`` section."""
        if self.detector is not None:
            self._section = self.detector.section("step")
            self._section.__enter__()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Close the section; report when due; stop after a checkpoint when the report says so."""
        det = self.detector
        if det is None:
            return
        if self._section is not None:
            self._section.__exit__(None, None, None)
            self._section = None
        report = det.report_if_due(trainer.global_step)
        if report is None:
            return
        self.reports.append(report)
        if report.stragglers:
            self.logger.warning(
                "stragglers at step %d: %s", trainer.global_step, dict(report.stragglers)
            )
        if det.should_stop and not trainer.should_stop:
            path = _stop_checkpoint_path(trainer)
            self.logger.warning(
                "straggler detected: saving %s and stopping the fit (stop_if_detected)", path
            )
            trainer.save_checkpoint(path)  # every rank: Lightning's save is collective
            trainer.should_stop = True
            self.stopped_fit = True

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Drop an open section (the batch never ended)."""
        self._section = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The detector belongs to one fit (its store namespace may not outlive it)."""
        if stage == "fit":
            self.detector = None


def _stop_checkpoint_path(trainer: pl.Trainer) -> str:
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            return os.path.join(cb.dirpath, f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}")
    return os.path.join(trainer.default_root_dir, "straggler-stop.ckpt")
