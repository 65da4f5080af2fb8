"""Type-check the four packages under their import names (CI, ``.ci/run``):

    python .ci/typecheck.py [MYPY ARGS ...]

mypy names a module after its file's folders, so ``mypy inprocess`` would call
``inprocess/config.py`` ``inprocess.config``, while the code imports it as
``restartable.inprocess.config`` (restartable/__init__.py says why): two names for one file, and
every import unresolved. This builds ``build/typecheck/restartable/``, a view of the repository
whose ``inprocess``, ``checkpoint``, ``rerun`` and ``straggler`` are links to the repository's
folders, and runs ``mypy -p restartable`` there with the repository's configuration.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VIEW = REPO / "build" / "typecheck"
PACKAGES = ("inprocess", "checkpoint", "rerun", "straggler")


def build_view() -> Path:
    """``VIEW/restartable``: restartable's own files and links to the four folders."""
    pkg = VIEW / "restartable"
    shutil.rmtree(VIEW, ignore_errors=True)
    pkg.mkdir(parents=True)
    for f in (REPO / "restartable").glob("*.py"):
        (pkg / f.name).symlink_to(f)
    for name in PACKAGES:
        (pkg / name).symlink_to(REPO / name, target_is_directory=True)
    return VIEW


def main(argv: list[str]) -> int:
    view = build_view()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml")]
    env = {**os.environ, "MYPYPATH": str(view)}
    return subprocess.run([*cmd, *argv, "-p", "restartable"], cwd=view, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
