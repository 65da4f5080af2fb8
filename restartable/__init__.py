"""restartable: in-process restart and multi-tier checkpointing for distributed PyTorch.

Every import goes through this one root: ``restartable.inprocess``, ``restartable.checkpoint``,
``restartable.rerun``, ``restartable.straggler`` (and ``python -m restartable.launch``), so that a
user's own ``checkpoint.py``, ``rerun.py``, ``straggler.py`` or ``inprocess.py`` next to a script
neither hides ours nor is hidden by them. Installed from a wheel, the four are folders of this
package. Run from the source tree (the repository root on ``sys.path``: pytest, ``PYTHONPATH``,
an editable install), they are the repository's top-level folders: this package's search path
then also holds the repository root, and only when those four folders are there.
"""

from __future__ import annotations

from pathlib import Path

SUBPACKAGES = ("inprocess", "checkpoint", "rerun", "straggler")


def source_tree_root(here: Path) -> Path | None:
    """The repository root when ``here`` (this package's folder) sits in the source tree beside
    the four folders of ``SUBPACKAGES``; None when they are inside ``here`` (an installed wheel)
    or not all beside it."""
    if (here / SUBPACKAGES[0]).is_dir():
        return None
    root = here.parent
    if all((root / name / "__init__.py").is_file() for name in SUBPACKAGES):
        return root
    return None


_root = source_tree_root(Path(__file__).resolve().parent)
if _root is not None and str(_root) not in __path__:
    __path__.append(str(_root))
