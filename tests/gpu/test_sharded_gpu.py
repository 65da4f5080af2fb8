"""FSDP2 on a GPU over NCCL through an in-process restart, restored from each checkpoint tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.workers_gpu import FAULT_STEP, SHARDED_TIERS
from tests.multiproc import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

W = "tests.gpu.workers_gpu:fsdp_nccl_training"


def _run(root: Path, *, fault: bool, tier: str) -> dict[str, Any]:
    (out,) = run_ranks(
        1,
        target=W,
        kwargs={"root": str(root), "fault": fault, "tier": tier},
        host_store=True,
        deadline=120,
    )
    assert "still referenced" not in out.output, out.output
    return {**out.result, "output": out.output, "same_pid": out.result["pid"] == out.pid}


@pytest.fixture(scope="module")
def clean_params(tmp_path_factory: pytest.TempPathFactory) -> list[list[float]]:
    r = _run(tmp_path_factory.mktemp("clean"), fault=False, tier="memory")
    assert [s["iteration"] for s in r["starts"]] == [0], r["output"]
    return r["params"]


@pytest.mark.parametrize("tier", SHARDED_TIERS)
def test_fsdp2_on_nccl_restarts_in_place_and_restores_its_dtensors_from_the_tier(
    tmp_path: Path, tier: str, clean_params: list[list[float]]
) -> None:
    r = _run(tmp_path, fault=True, tier=tier)
    assert r["same_pid"]  # restarted inside the process
    assert [s["iteration"] for s in r["starts"]] == [0, 1], r["output"]
    back = r["starts"][1]
    assert (back["step"], back["tier"]) == (FAULT_STEP, tier), back
    # The freshly built FSDP2 model and optimizer got their shards back on the GPU.
    assert back["dtensors_on_gpu"], back
    # No destroyed NCCL group kept alive by the mesh or FSDP's state: the restart's barrier did
    # not wait for a group timeout.
    assert back["barrier_s"] is not None and back["barrier_s"] < 1.5, back
    # Bit for bit the run without the fault.
    assert r["params"] == clean_params
