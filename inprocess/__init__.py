"""In-process restart: ``@restartable`` re-runs ``train()`` in the same processes after a fault.

``restartable`` is imported on first use (PEP 562): ``import inprocess`` and its torch-free
parts (``inprocess.faults``' plan parser, the launcher's argument parsing) do not import torch.
``context`` is imported eagerly: it shares its name with the submodule ``inprocess.context``,
which would otherwise shadow it once anything imported that submodule.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from inprocess.config import RestartConfig
from inprocess.context import RestartContext, RestartRecord, context
from inprocess.errors import InprocessError, RestartAbortedError

if TYPE_CHECKING:
    from inprocess.restart.loop import restartable

__all__ = [
    "InprocessError",
    "RestartAbortedError",
    "RestartConfig",
    "RestartContext",
    "RestartRecord",
    "context",
    "restartable",
]


def __getattr__(name: str) -> Any:
    if name != "restartable":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module("inprocess.restart.loop").restartable
