"""Snapshot and restore of every RNG a step may draw from: Python, NumPy, torch CPU and CUDA."""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class RngSnapshot:
    """The RNG states at the start of a step (plus optional user state, e.g. a TP RNG tracker)."""

    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] | None  # one state per visible device; None without CUDA
    extra: Any = None

    def to_bytes(self) -> bytes:
        """Serialise for a checkpoint, so a resumed job replays the step from disk alone."""
        buf = io.BytesIO()
        torch.save(
            {
                "python": self.python,
                "numpy": self.numpy,
                "torch_cpu": self.torch_cpu,
                "cuda": self.cuda,
                "extra": self.extra,
            },
            buf,
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> RngSnapshot:
        d = safe_load(data)
        snap = cls(d["python"], d["numpy"], d["torch_cpu"], d["cuda"], d["extra"])
        # Tried on throwaway generators: a state they refuse fails here (the field named by the
        # caller), not at the restore of a re-run much later.
        try:
            random.Random().setstate(snap.python)
            np.random.RandomState().set_state(snap.numpy)
            torch.Generator().set_state(snap.torch_cpu)
        except (TypeError, ValueError, RuntimeError, KeyError, IndexError) as e:
            raise ValueError(f"not the RNG states of a step ({type(e).__name__}: {e})") from e
        if snap.cuda is not None and not (
            isinstance(snap.cuda, list) and all(isinstance(t, torch.Tensor) for t in snap.cuda)
        ):
            raise ValueError("'cuda' is not a list of CUDA RNG state tensors")
        return snap


def safe_load(data: bytes) -> Any:
    """``torch.load(weights_only=True)`` of ``data`` (a checkpoint file is input: no code runs
    from it), with the NumPy types of ``numpy.random.get_state()`` allowlisted. Raises
    ``pickle.UnpicklingError`` for anything else."""
    multiarray = getattr(np, "_core", np.core).multiarray  # numpy 2 / 1
    dtypes = {type(np.dtype(c)) for c in "?bhilqBHILQefdgFDG"}
    plain = [bytes, bytearray, set, frozenset]
    allowed = [*plain, multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *dtypes]
    with torch.serialization.safe_globals(allowed):
        return torch.load(io.BytesIO(data), weights_only=True)


def _cuda_in_use() -> bool:
    # Only when CUDA was initialised: never create a CUDA context just to read its RNG.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture(save_extra: Callable[[], Any] | None = None) -> RngSnapshot:
    """Read all RNG states. Host-side only: no device synchronisation."""
    return RngSnapshot(
        python=random.getstate(),
        numpy=np.random.get_state(),
        torch_cpu=torch.get_rng_state(),
        cuda=torch.cuda.get_rng_state_all() if _cuda_in_use() else None,
        extra=save_extra() if save_extra is not None else None,
    )


def restore(snap: RngSnapshot, restore_extra: Callable[[Any], None] | None = None) -> None:
    """Put every RNG back to ``snap``; a CUDA state is restored only where CUDA is in use."""
    random.setstate(snap.python)
    np.random.set_state(snap.numpy)
    torch.set_rng_state(snap.torch_cpu)
    if snap.cuda is not None and torch.cuda.is_available():
        n = min(len(snap.cuda), torch.cuda.device_count())
        for i in range(n):
            torch.cuda.set_rng_state(snap.cuda[i], i)
    if restore_extra is not None:
        restore_extra(snap.extra)
