"""In-process restart: ``@restartable`` re-runs ``train()`` in the same processes after a fault.

``restartable`` is imported on first use (PEP 562): ``import restartable.inprocess`` and its
torch-free parts (``inprocess.faults``' plan parser, the launcher's argument parsing) do not import
torch. ``context`` is imported eagerly: it shares its name with the submodule ``inprocess.context``,
which would otherwise shadow it once anything imported that submodule.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from restartable.inprocess.config import RestartConfig
from restartable.inprocess.context import RestartContext, RestartRecord, context
from restartable.inprocess.errors import InprocessError, RestartAbortedError

if __name__ != "restartable.inprocess":  # the source tree's folder, imported by its old name
    raise ImportError(
        f"{__name__!r} is restartable's inprocess/ folder imported by its old name: "
        "import restartable.inprocess instead (python -m restartable.launch for the launcher)"
    )

if TYPE_CHECKING:
    from restartable.inprocess.restart.loop import restartable

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
    return importlib.import_module("restartable.inprocess.restart.loop").restartable
