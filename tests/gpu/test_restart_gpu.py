"""In-process restarts on a GPU: NCCL's abort and a new communicator; CUDA state restored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.workers_gpu import SOFT_TIMEOUT_S
from tests.multiproc import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

W = "tests.gpu.workers_gpu"


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_nccl_fault_aborts_the_communicator_and_the_next_iteration_reduces_on_a_new_one(
    fault: str,
) -> None:
    (out,) = run_ranks(
        1,
        target=f"{W}:nccl_fault_then_all_reduce",
        kwargs={"fault": fault},
        host_store=True,
        deadline=90,
    )
    r = out.result
    assert r["pid"] == out.pid  # restarted in the same process
    first, second = r["seen"]
    assert [first["iteration"], second["iteration"]] == [0, 1], out.output
    # Both iterations reduced CUDA tensors over NCCL (one rank: the sum is the input).
    assert first["backend"] == second["backend"] == "nccl"
    assert first["sum"] == 1.0 * (1 << 16) and second["sum"] == 2.0 * (1 << 16)
    assert first["nccl_groups"] == second["nccl_groups"] == 1
    # The restart aborted the one NCCL group once (monitor or main thread, whichever came
    # first; the other found nothing left) before iteration 1 created its own; the end of the
    # job aborted that one.
    assert second["aborts_before"] == [1], second
    assert r["aborted"] == [1, 1], r["aborted"]
    assert "NCCL abort failed" not in out.output, out.output
    assert "still referenced" not in out.output, out.output
    assert r["result"] == {"sum": 2.0 * (1 << 16), "iteration": 1}
    if fault == "hang":
        # The restart cut the 60 s sleep short at soft_timeout.
        assert SOFT_TIMEOUT_S <= first["hang_interrupted_after"] < SOFT_TIMEOUT_S + 5.0, first


def test_two_ranks_over_gloo_restore_cuda_state_and_end_equal_to_a_clean_run(
    tmp_path: Path,
) -> None:
    clean = run_ranks(
        2,
        target=f"{W}:gloo_cuda_training",
        kwargs={"root": str(tmp_path / "clean"), "fault": False},
        host_store=True,
        deadline=120,
    )
    faulty = run_ranks(
        2,
        target=f"{W}:gloo_cuda_training",
        kwargs={"root": str(tmp_path / "faulty"), "fault": True},
        host_store=True,
        deadline=120,
    )
    for c, f in zip(clean, faulty, strict=True):
        assert [s["iteration"] for s in c.result["starts"]] == [0]
        assert [s["iteration"] for s in f.result["starts"]] == [0, 1], f.output
        back = f.result["starts"][1]
        # Saved after step 5 (state step 5), restored from host memory onto the GPU.
        assert (back["step"], back["tier"], back["on_gpu"]) == (5, "memory", True), back
        # Bit for bit the parameters of the run without the fault (2 ranks: gloo sums in a
        # fixed order).
        assert f.result["params"] == c.result["params"]
