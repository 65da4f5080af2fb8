"""Health checks on this CPU host: GPU checks are skipped (logged once), user checks decide."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from restartable.inprocess.restart.health import HealthChecker


def test_cpu_host_is_healthy_and_skip_is_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU host, also on a GPU one
    caplog.set_level(logging.INFO, logger="restartable.inprocess.restart.health")
    with HealthChecker() as checker:
        assert checker.check() is None
        assert checker.check() is None
    skips = [r for r in caplog.records if "skipped: no GPU / NVML" in r.getMessage()]
    assert len(skips) == 1
    # A second checker (a new rank, or a new test) logs again: no module-level state.
    with HealthChecker() as checker:
        checker.check()
    skips = [r for r in caplog.records if "skipped: no GPU / NVML" in r.getMessage()]
    assert len(skips) == 2


def test_cpu_device_is_skipped() -> None:
    with HealthChecker(device=torch.device("cpu")) as checker:
        assert checker.check() is None


def test_failing_user_check_gives_its_reason() -> None:
    calls = []

    def ok() -> None:
        calls.append("ok")

    def disk_full() -> None:
        raise OSError("scratch disk is full")

    with HealthChecker(user_checks=[ok, disk_full]) as checker:
        reason = checker.check()
    assert calls == ["ok"]
    assert reason is not None
    assert "disk_full" in reason
    assert "OSError: scratch disk is full" in reason


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(TypeError, match="user_checks holds 3"):
        HealthChecker(user_checks=[3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"cuda_timeout \(0\)"):
        HealthChecker(cuda_timeout=0)


def test_check_after_close_is_an_error() -> None:
    checker = HealthChecker()
    checker.close()
    checker.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        checker.check()


class _NVMLError(Exception):
    pass


def _fake_nvml(**answers: Any) -> SimpleNamespace:
    def query(name: str) -> Any:
        def f(*_: Any) -> Any:
            value = answers.get(name)
            if value is None:
                raise _NVMLError(f"{name}: not supported")
            return value

        return f

    return SimpleNamespace(
        NVMLError=_NVMLError,
        NVML_FEATURE_ENABLED=1,
        NVML_SUCCESS=0,
        NVML_FI_DEV_GET_GPU_RECOVERY_ACTION=None,
        nvmlDeviceGetUUID=lambda h: "GPU-fake",
        nvmlDeviceGetRetiredPagesPendingStatus=query("pending"),
        nvmlDeviceGetRemappedRows=query("remap"),
        nvmlEventSetWait_v2=query("xid"),
        nvmlShutdown=lambda: None,
    )


def _nvml_reason(fake: SimpleNamespace) -> str | None:
    checker = HealthChecker()
    checker._nvml, checker._nvml_handle = fake, object()
    return checker._check_nvml(0)


def test_nvml_reports_pending_pages_and_remaps_and_ignores_unsupported_queries() -> None:
    assert _nvml_reason(_fake_nvml()) is None  # nothing supported: healthy, not unhealthy
    assert _nvml_reason(_fake_nvml(pending=0, remap=(0, 0, 0, 0))) is None
    reason = _nvml_reason(_fake_nvml(pending=1, remap=(0, 1, 1, 0)))
    assert reason is not None
    assert "retired pages pending" in reason
    assert "row remaps pending" in reason
