"""Issue 19: the Lightning callbacks reject bad arguments at construction (field, value, fix),
and, in one process with a real ``Trainer``, the tiered checkpoint round trip and the
fault-tolerance callback's refusal to run outside ``ft.restartable()``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from restartable.checkpoint import CheckpointConfigError, CheckpointManager
from restartable.checkpoint.lightning import TieredCheckpoint, read_pointer
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.lightning import FaultToleranceCallback
from restartable.straggler import ConfigError as StragglerConfigError
from restartable.straggler.lightning import StragglerDetectionCallback
from tests.dist.workers_lightning import Regression, data

# ----- FaultToleranceCallback ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"autoresume": "yes"}, ["autoresume ('yes')", "True or False"]),
        ({"calculate_timeouts": 1}, ["calculate_timeouts (1)", "True or False"]),
        (
            {"calculate_timeouts": True},
            ["calculate_timeouts (True)", "exp_dir (None)", "pass exp_dir="],
        ),
        ({"autoresume": True}, ["autoresume (True)", "pass exp_dir= or finished_flag_file="]),
        ({"exp_dir": ""}, ["exp_dir ('')", "non-empty path"]),
        (
            {"simulated_fault_params": {"fault_type": "rank_killed"}},
            ["simulated_fault_params ({'fault_type': 'rank_killed'})", "--simulated-fault-type"],
        ),
        ({"logger_name": ""}, ["logger_name ('')", "non-empty string"]),
    ],
)
def test_fault_tolerance_callback_rejects_bad_arguments(
    kwargs: dict[str, Any], words: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FAULT_TOL_FINISHED_FLAG_FILE", raising=False)
    with pytest.raises(ConfigError) as err:
        FaultToleranceCallback(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_autoresume_takes_nvidias_flag_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(tmp_path / "done"))
    assert FaultToleranceCallback(autoresume=True).finished_flag_file == tmp_path / "done"


@pytest.mark.parametrize("option", ["calculate_timeouts", "timeouts_state_path"])
def test_restartable_refuses_the_options_it_takes_from_the_callback(option: str) -> None:
    ft = FaultToleranceCallback()
    with pytest.raises(ConfigError) as err:
        ft.restartable(**{option: 2})
    assert option in str(err.value) and "FaultToleranceCallback(" in str(err.value)


def test_restartable_never_shrinks_a_trainers_world_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Trainer's devices x num_nodes is fixed: without a reserve to fill a lost rank's place,
    # the in-process path must end (the launcher restarts every rank), not go on with fewer.
    from restartable.inprocess.restart import loop

    seen: list[dict[str, object]] = []
    monkeypatch.setattr(loop, "restartable", lambda **kw: seen.append(kw) or (lambda fn: fn))
    monkeypatch.setenv("WORLD_SIZE", "4")
    FaultToleranceCallback().restartable()
    FaultToleranceCallback().restartable(active_world_size=3)
    FaultToleranceCallback().restartable(active_world_size=3, min_active_world_size=2)
    assert [kw["min_active_world_size"] for kw in seen] == [4, 3, 2]


def test_restartable_passes_restart_config_errors_through() -> None:
    with pytest.raises(ConfigError) as err:
        FaultToleranceCallback().restartable(soft_timeout=60.0, hard_timeout=30.0)
    assert "hard_timeout (30.0)" in str(err.value), str(err.value)


def test_fit_outside_ft_restartable_fails_with_the_fix(tmp_path: Path) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        callbacks=[FaultToleranceCallback()],
    )
    with pytest.raises(ConfigError) as err:
        trainer.fit(Regression(), train_dataloaders=data())
    assert "@ft.restartable" in str(err.value), str(err.value)


# ----- StragglerDetectionCallback --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"gpu_relative_perf_threshold": 1.5}, ["gpu_relative_perf_threshold", "1.5"]),
        ({"report_time_interval": 0}, ["report_time_interval", "0"]),
        ({"report_interval": 5}, ["report_interval", "DetectorConfig"]),
        (
            {"num_gpu_perf_scores_to_log": 3, "num_gpu_perf_scores_to_print": 4},
            ["num_gpu_perf_scores_to_log (3)", "num_gpu_perf_scores_to_print (4)", "pass only"],
        ),
        ({"logger_name": ""}, ["logger_name ('')", "non-empty string"]),
    ],
)
def test_straggler_callback_rejects_bad_arguments(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(StragglerConfigError) as err:
        StragglerDetectionCallback(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_straggler_callback_takes_the_seeds_names() -> None:
    cb = StragglerDetectionCallback(
        report_time_interval=60.0,
        calc_relative_gpu_perf=True,
        calc_individual_gpu_perf=False,
        num_gpu_perf_scores_to_log=3,
        gpu_relative_perf_threshold=0.6,
        gpu_individual_perf_threshold=0.7,
        stop_if_detected=True,
        logger_name="nemo_logger.StragglerDetectionCallback",
    )
    assert cb.config.num_gpu_perf_scores_to_print == 3
    assert cb.config.stop_if_detected and not cb.config.calc_individual_gpu_perf
    assert cb.logger.name == "nemo_logger.StragglerDetectionCallback"


# ----- TieredCheckpoint ------------------------------------------------------------------------


def test_tiered_checkpoint_rejects_what_is_not_a_manager() -> None:
    with pytest.raises(CheckpointConfigError) as err:
        TieredCheckpoint("ckpts/")  # type: ignore[arg-type]
    assert "manager (str)" in str(err.value) and "CheckpointManager(" in str(err.value)


def _fit(tmp_path: Path, mgr: CheckpointManager, epochs: int, ckpt: str | None) -> Regression:
    L.seed_everything(0, verbose=False)
    model = Regression()
    last = ModelCheckpoint(dirpath=str(tmp_path / "ptl"), every_n_train_steps=1, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[TieredCheckpoint(mgr), last],
    )
    trainer.fit(model, train_dataloaders=data(), ckpt_path=ckpt)
    return model


def test_resume_from_last_restores_the_memory_tier_and_matches_a_clean_run(tmp_path: Path) -> None:
    # One process, one device: 2 batches per epoch. Epoch-aligned resume (see workers_lightning).
    with CheckpointManager(str(tmp_path / "ckpt"), persistent_every=4, local_every=1) as mgr:
        _fit(tmp_path, mgr, 3, None)
        pointer = read_pointer(tmp_path / "ptl" / "last.ckpt")
        assert pointer is not None and pointer["step"] == 6, pointer
        resumed = _fit(tmp_path, mgr, 5, "last")
        assert mgr.last_restore is not None
        assert (mgr.last_restore.step, mgr.last_restore.tier) == (6, "memory")
        assert [s for s, _ in resumed.losses] == [6, 7, 8, 9]
        assert [
            int(p.name.split("_")[1].split("-")[0])
            for p in sorted((tmp_path / "ckpt").glob("step_*"))
        ] == [4, 8]
    with CheckpointManager(str(tmp_path / "clean"), persistent_every=100) as clean_mgr:
        clean = _fit(tmp_path / "c", clean_mgr, 5, None)
    assert resumed.losses[-1] == clean.losses[-1]
