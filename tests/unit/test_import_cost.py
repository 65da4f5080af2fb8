"""What a ``@restartable`` rank imports: torch.distributed.checkpoint (about 1 s of CPU per
process) only once the program uses a checkpoint manager, not through the etcd store's import of
``checkpoint.exchange`` (that made every rank, reserves included, start 1 s later)."""

from __future__ import annotations

import subprocess
import sys

from restartable import checkpoint

_PROBE = (
    "import sys, restartable.inprocess, restartable.inprocess.restart.loop; "
    "print('torch.distributed.checkpoint' in sys.modules)"
)


def test_the_wrapper_does_not_import_torch_distributed_checkpoint() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_every_public_name_of_checkpoint_resolves() -> None:
    for name in checkpoint.__all__:
        assert getattr(checkpoint, name).__name__ == name
    assert sorted(checkpoint.__all__) == sorted(checkpoint._HOMES)
