"""Issue 47: an exception ``train()`` raised is told as the rank's own error (ERROR, with its
traceback, once per error) unless it is a failed communication (one WARNING line)."""

from __future__ import annotations

import logging
import traceback

import pytest
import torch
import torch.distributed as dist

from restartable.inprocess.protocol.store import as_store
from restartable.inprocess.restart.raised import raised_in_collective, report_raised


def _raised_in(path: str, exc: Exception) -> Exception:
    """``exc`` raised by code whose file is ``path`` (as torch's own frames would be)."""
    code = compile("raise exc", path, "exec")
    try:
        exec(code, {"exc": exc})
    except Exception as e:
        return e
    raise AssertionError("not raised")


C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def test_a_communication_error_in_a_collective_is_a_peers_fault() -> None:
    assert raised_in_collective(_raised_in(C10D, RuntimeError("Connection closed by peer")))
    assert raised_in_collective(_raised_in("/x/train.py", dist.DistBackendError("gloo")))


def test_a_code_error_inside_torch_distributed_is_the_ranks_own() -> None:
    assert not raised_in_collective(_raised_in(C10D, NotImplementedError("no strategy")))
    assert not raised_in_collective(_raised_in(C10D, ValueError("bad argument")))
    assert not raised_in_collective(_raised_in("/x/model.py", RuntimeError("shape mismatch")))


def test_dtensors_rewrapped_operator_error_is_the_ranks_own(group: None) -> None:
    # DTensor's dispatch re-raises an operator's error as a RuntimeError in torch.distributed's
    # code, `from` the original (raised in torch._subclasses): seen as "a collective failed".
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    x = distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
    with pytest.raises(RuntimeError, match="Sharding propagation failed") as info:
        torch.nonzero(x)
    assert "/torch/distributed/" in traceback.extract_tb(info.value.__traceback__)[-1].filename
    assert not raised_in_collective(info.value)


def test_the_same_error_on_two_ranks_logs_one_traceback(caplog: pytest.LogCaptureFixture) -> None:
    store = as_store(dist.HashStore())
    exc = NotImplementedError("no sharding strategy")
    caplog.set_level(logging.INFO)
    for rank in (1, 0):
        report_raised(
            store,
            exc,
            me=rank,
            iteration=3,
            step=7,
            where="/x/model.py:223",
            trace=f"Traceback (most recent call last):\n  model.py:223 (rank {rank})",
            in_collective=False,
        )
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.exc_text for r in errors] == [
        "Traceback (most recent call last):\n  model.py:223 (rank 1)",
        None,
    ]
    assert errors[0].getMessage() == "rank 1: train() raised in iteration 3"
    assert errors[1].getMessage() == (
        "rank 0: train() raised in iteration 3 the same error as rank 1, whose traceback is "
        "logged: NotImplementedError: no sharding strategy"
    )
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
