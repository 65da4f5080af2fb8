"""Every private torch API the ``straggler`` package uses, in one place (see
``checkpoint/_torch_private.py`` for why; ``tests/unit/test_torch_private.py`` checks it)."""

from __future__ import annotations

from typing import Any


def default_store() -> Any:
    """The store the current default process group was created with."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()
