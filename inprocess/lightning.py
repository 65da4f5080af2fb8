"""PyTorch Lightning integration: ``FaultToleranceCallback`` times ``setup`` / ``step`` /
``checkpointing`` sections (learned timeouts), feeds the run journal, writes the finished flag,
and runs ``trainer.fit()`` under ``@restartable``.

A fault restarts ``fit()`` in place: every rank unwinds it, re-enters ``train()`` in the same
process, and ``fit(ckpt_path="last")`` resumes from the fastest tier; a warm reserve may take a
lost rank's place. Lightning takes a process's rank from LOCAL_RANK / GROUP_RANK / WORLD_SIZE
(its ``ClusterEnvironment``), which the restart loop rewrites for each iteration
(``inprocess.restart.torchrun_env``), so after a renumbering Lightning's rank is the process
group's; the callback checks that it is at ``setup``. The world never shrinks by default
(``min_active_world_size`` is the active world): a Trainer's ``devices x num_nodes`` is fixed.
When no reserve can fill a lost rank's place, the launcher restarts every rank
(``--max-restarts``).

Needs the ``lightning`` extra (``pip install -e ".[lightning]"``). See docs/lightning.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

try:
    import lightning.pytorch as pl
except ImportError as exc:  # an optional extra: say how to get it
    raise ImportError(
        f'{__name__} needs PyTorch Lightning ({exc}): pip install -e ".[lightning]"'
    ) from exc

from restartable.checkpoint.private_files import replace_private
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.context import RestartContext, context
from restartable.inprocess.errors import ConfigError, ContextError, InprocessError

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
FINISHED_FLAG_ENV = "FAULT_TOL_FINISHED_FLAG_FILE"  # NVIDIA's name for the finished flag
# Options ft.restartable() sets itself from the callback's own arguments.
_OWNED = ("calculate_timeouts", "timeouts_state_path")
# Set while a train() decorated by ft.restartable() runs: setup() checks it.
_UNDER: contextvars.ContextVar[FaultToleranceCallback] = contextvars.ContextVar("inprocess_ptl")


class LightningRestartError(InprocessError):
    """``fit()`` was about to run where Lightning's view of the ranks is not the group's."""


class FaultToleranceCallback(pl.Callback):
    """Fault tolerance for ``trainer.fit()`` (the seeds' ``FaultToleranceCallback`` names).

    * ``autoresume``: when ``fit`` completes, global rank 0 writes the finished flag
      (``finished_flag_file``, else ``$FAULT_TOL_FINISHED_FLAG_FILE``, else
      ``exp_dir/finished.flag``): a batch script stops requeueing once it exists. The requeue
      flag itself is the launcher's ``--autoresume-file``.
    * ``calculate_timeouts``: learn the ``setup`` / ``step`` / ``checkpointing`` timeouts from
      observed durations, kept in ``exp_dir/ft_state.json`` across launches and in-job restarts.
    * ``exp_dir``: where ``ft_state.json``, the run journal (``exp_dir/journal``) and the
      finished flag go. Required by ``calculate_timeouts`` and (without a flag path) by
      ``autoresume``.
    * ``simulated_fault_params``: not supported here; the launcher's drill does it
      (``--simulated-fault-type``), so that a fault fires once per job, not once per restart.
    * ``logger_name``: the logger of this callback's records.
    * ``clock``: the finished flag's time (``clock.wall()``; tests pass a fake one).

    Use::

        ft = FaultToleranceCallback(autoresume=True, calculate_timeouts=True, exp_dir="runs/x")

        @ft.restartable(soft_timeout=60.0, hard_timeout=90.0)
        def train():
            trainer = L.Trainer(..., callbacks=[ft, ...])
            trainer.fit(model, ckpt_path="last")

    and launch with ``python -m restartable.launch --nproc-per-node N --max-restarts K`` (N may
    exceed the Trainer's ``devices``: pass ``active_world_size`` and the rest are warm reserves).
    """

    def __init__(
        self,
        *,
        autoresume: bool = False,
        calculate_timeouts: bool = False,
        exp_dir: str | os.PathLike[str] | None = None,
        simulated_fault_params: Any = None,
        logger_name: str | None = None,
        finished_flag_file: str | os.PathLike[str] | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        for name, value in (("autoresume", autoresume), ("calculate_timeouts", calculate_timeouts)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} ({value!r}) must be True or False")
        for name, path in (("exp_dir", exp_dir), ("finished_flag_file", finished_flag_file)):
            if path is not None and (not isinstance(path, (str, os.PathLike)) or not str(path)):
                raise ConfigError(f"{name} ({path!r}) must be a non-empty path or None")
        if simulated_fault_params is not None:
            raise ConfigError(
                f"simulated_fault_params ({simulated_fault_params!r}) is not supported by the "
                "callback: a fault fired from train() would fire again after every restart; use "
                "the launcher's drill, python -m restartable.launch --simulated-fault-type "
                "rank_killed --simulated-fault-base-delay 30 ... (docs/launching.md)"
            )
        if logger_name is not None and (not isinstance(logger_name, str) or not logger_name):
            raise ConfigError(f"logger_name ({logger_name!r}) must be a non-empty string or None")
        if calculate_timeouts and exp_dir is None:
            raise ConfigError(
                "calculate_timeouts (True) needs exp_dir (None): learned timeouts reach the "
                "processes of an in-job restart only through exp_dir/ft_state.json; pass "
                "exp_dir='runs/<name>'"
            )
        flag = finished_flag_file or os.environ.get(FINISHED_FLAG_ENV) or None
        if flag is None and exp_dir is not None:
            flag = os.path.join(exp_dir, "finished.flag")
        if autoresume and flag is None:
            raise ConfigError(
                f"autoresume (True) needs a place for the finished flag: pass exp_dir= or "
                f"finished_flag_file=, or set ${FINISHED_FLAG_ENV}"
            )
        self.autoresume = autoresume
        self.calculate_timeouts = calculate_timeouts
        self.exp_dir = None if exp_dir is None else Path(exp_dir)
        self.finished_flag_file = None if flag is None else Path(flag)
        self.logger = logging.getLogger(logger_name) if logger_name else log
        self._ctx: RestartContext | None = None
        self._sections: dict[str, contextlib.ExitStack] = {}
        self._clock = clock  # the finished flag's "time"

    # ----- running fit() under @restartable ------------------------------------------------------

    def restartable(self, **options: Any) -> Callable[[F], F]:
        """``@restartable`` for a ``train()`` that calls ``trainer.fit()``.

        ``options`` are ``RestartConfig``'s fields except ``calculate_timeouts`` and
        ``timeouts_state_path``, which come from the callback. ``min_active_world_size``
        defaults to the active world (``active_world_size``, else the launch's WORLD_SIZE): a
        Trainer's ``devices x num_nodes`` cannot shrink, so a lost rank without a reserve to
        take its place ends the in-process path and the launcher's in-job restart
        (``--max-restarts``) takes over. ``journal_dir`` defaults to ``exp_dir/journal``
        (unless ``$RESTARTABLE_JOURNAL_DIR`` is set). Called once, at import time, before
        ``train()`` runs.
        """
        # imports torch; keep this module light
        from restartable.inprocess.restart.loop import restartable

        owned = sorted(set(options) & set(_OWNED))
        if owned:
            raise ConfigError(
                f"FaultToleranceCallback.restartable got {owned}: it sets them from the "
                "callback (FaultToleranceCallback(calculate_timeouts=..., exp_dir=...)); drop "
                "them here"
            )
        if "min_active_world_size" not in options:
            world = options.get("active_world_size") or int(os.environ.get("WORLD_SIZE", "1"))
            options["min_active_world_size"] = world
        options["calculate_timeouts"] = self.calculate_timeouts
        if self.exp_dir is not None:
            options["timeouts_state_path"] = str(self.exp_dir / "ft_state.json")
            if "journal_dir" not in options and not os.environ.get("RESTARTABLE_JOURNAL_DIR"):
                options["journal_dir"] = str(self.exp_dir / "journal")
        decorator = restartable(**options)

        def decorate(fn: F) -> F:
            @functools.wraps(fn)
            def train(*args: Any, **kwargs: Any) -> Any:
                token = _UNDER.set(self)
                try:
                    return fn(*args, **kwargs)
                finally:
                    _UNDER.reset(token)

            return decorator(train)  # type: ignore[return-value]

        return decorate

    # ----- Lightning hooks ---------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check that this fit may run here; open ``setup``; hand ``checkpointing`` to savers."""
        if stage != "fit":
            return
        if _UNDER.get(None) is not self:
            raise ConfigError(
                "FaultToleranceCallback: trainer.fit() runs outside a train() decorated with "
                "this callback's restartable(): decorate it with @ft.restartable(...) and launch "
                "with python -m restartable.launch (docs/lightning.md)"
            )
        try:
            ctx = context()
        except ContextError as exc:  # unreachable through restartable(); kept for clarity
            raise ConfigError(str(exc)) from None
        if (trainer.global_rank, trainer.world_size) != (ctx.rank, ctx.world_size):
            raise LightningRestartError(
                f"Lightning sees rank {trainer.global_rank} of {trainer.world_size} but the "
                f"process group has rank {ctx.rank} of {ctx.world_size} (iteration "
                f"{ctx.iteration}): Lightning reads ranks from LOCAL_RANK/GROUP_RANK/WORLD_SIZE, "
                "which the restart loop sets for each iteration: was the environment changed, "
                "or the Trainer's devices x num_nodes not the active world "
                f"({ctx.world_size})?"
            )
        self._ctx = ctx
        self._sections = {}
        self._open("setup")
        for cb in _callbacks(trainer):  # duck-typed: checkpoint.lightning.TieredCheckpoint
            if hasattr(cb, "save_section"):
                cb.save_section = ctx.section

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Set-up (restore, DDP wrap, sanity check) is over."""
        self._close("setup")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Open the ``step`` section."""
        self._open("step")

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Close ``step``; the step number goes to the journal and the repeated-fault rule."""
        self._close("step")
        if self._ctx is not None:
            self._ctx.ping(step=trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``fit`` ran to its end: write the finished flag (global rank 0)."""
        self._close_all()
        stopped = [cb for cb in _callbacks(trainer) if getattr(cb, "stopped_fit", False)]
        if not self.autoresume or stopped or trainer.global_rank != 0:
            return
        assert self.finished_flag_file is not None  # checked at construction
        _write_json(
            self.finished_flag_file,
            {"finished": True, "global_step": trainer.global_step, "time": self._clock.wall()},
        )
        self.logger.info("training finished: flag %s written", self.finished_flag_file)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Close the open sections with the exception (the restart loop takes it from here)."""
        for name in list(self._sections):
            stack = self._sections.pop(name)
            stack.__exit__(type(exception), exception, exception.__traceback__)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Drop the context: it is valid during one ``train()`` call only."""
        if stage == "fit":
            self._close_all()
            self._ctx = None
            for cb in _callbacks(trainer):  # the section belongs to this call's context
                if hasattr(cb, "save_section"):
                    cb.save_section = None

    # ----- sections ----------------------------------------------------------------------------

    def _open(self, name: str) -> None:
        if self._ctx is None or name in self._sections:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(self._ctx.section(name))
        self._sections[name] = stack

    def _close(self, name: str) -> None:
        stack = self._sections.pop(name, None)
        if stack is not None:
            stack.close()

    def _close_all(self) -> None:
        for name in list(self._sections):
            self._close(name)


def _callbacks(trainer: pl.Trainer) -> list[Any]:
    """The Trainer's callbacks (set by Lightning's callback connector; not declared for mypy)."""
    return list(getattr(trainer, "callbacks", []))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically (a reader sees the old file or the new one, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_private(path, (json.dumps(data, sort_keys=True) + "\n").encode())
