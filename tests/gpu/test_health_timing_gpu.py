"""On a GPU: the health check runs a kernel and reads NVML; straggler sections time the device."""

from __future__ import annotations

import logging

import pytest
import torch

from restartable.inprocess.restart.health import HealthChecker
from restartable.straggler import Detector

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_health_check_of_a_healthy_gpu_runs_cuda_and_nvml(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("pynvml", reason="nvidia-ml-py is a dependency of the project")
    caplog.set_level(logging.DEBUG, logger="restartable.inprocess.restart.health")
    with HealthChecker() as checker:
        assert checker.check() is None
        assert checker.check() is None  # NVML stays initialised between checks
        # NVML answered for this device, found by its PCI id (not by a skipped check).
        assert checker._nvml is not None
        uuid = checker._nvml.nvmlDeviceGetUUID(checker._nvml_handle)
        assert str(uuid).startswith("GPU-"), uuid
    assert "skipped" not in caplog.text
    assert "lookup by PCI id failed" not in caplog.text, caplog.text


def test_cuda_device_of_a_checker_for_the_cpu_is_skipped() -> None:
    with HealthChecker(device=torch.device("cpu")) as checker:
        assert checker.check() is None
        assert checker._nvml is None


def test_cuda_timer_measures_device_time_not_the_launch() -> None:
    det = Detector(timer="cuda")
    cycles = 50_000_000  # about 25 ms at 2 GHz: far above a launch's microseconds
    torch.cuda._sleep(1000)  # warm-up
    torch.cuda.synchronize()
    for _ in range(3):
        with det.section("step"):
            torch.cuda._sleep(cycles)  # returns at once; the kernel runs on
    sec = det.section("step")
    sec.collect()
    assert len(sec.samples) == 3
    assert all(s > 0.005 for s in sec.samples), list(sec.samples)
