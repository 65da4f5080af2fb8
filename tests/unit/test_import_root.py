"""Issue 47: one import root, ``restartable.*``. From the source tree the four packages are the
repository's top-level folders; installed from a wheel they are folders of ``restartable/``; an
old top-level name (``inprocess``, say) fails at once, naming the one to import instead."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import restartable
import restartable.checkpoint
import restartable.inprocess
from restartable import SUBPACKAGES, source_tree_root
from tests.multiproc import REPO_ROOT


def _python(code: str, *, path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin"},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_from_the_source_tree_the_packages_are_the_repositorys_folders() -> None:
    assert str(REPO_ROOT) in restartable.__path__
    assert Path(restartable.inprocess.__file__) == REPO_ROOT / "inprocess" / "__init__.py"
    assert Path(restartable.checkpoint.__file__) == REPO_ROOT / "checkpoint" / "__init__.py"
    assert source_tree_root(REPO_ROOT / "restartable") == REPO_ROOT


def test_the_search_path_is_extended_only_beside_the_four_folders(tmp_path: Path) -> None:
    installed = tmp_path / "site" / "restartable"
    for name in SUBPACKAGES:
        (installed / name).mkdir(parents=True)
        (installed / name / "__init__.py").write_text("")
    assert source_tree_root(installed) is None  # a wheel: they are inside
    lone = tmp_path / "lone" / "restartable"
    lone.mkdir(parents=True)
    (tmp_path / "lone" / "inprocess").mkdir()  # one folder of that name is not the tree
    assert source_tree_root(lone) is None


def test_installed_as_a_wheel_lays_them_out_the_packages_resolve_inside(tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(REPO_ROOT / "restartable", site / "restartable")
    for name in SUBPACKAGES:
        shutil.copytree(
            REPO_ROOT / name, site / "restartable" / name, ignore=shutil.ignore_patterns("*.pyc")
        )
    (tmp_path / "checkpoint.py").write_text("WHO = 'user'\n")  # the user's, in the cwd
    done = _python(
        "import sys; sys.path.insert(0, '');"
        "import checkpoint, restartable, restartable.checkpoint.sealing as s;"  # names: keep
        "print(checkpoint.WHO, restartable.__path__, s.__file__)",
        path=site,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "user",
        f"[{str(site / 'restartable')!r}]",
        str(site / "restartable" / "checkpoint" / "sealing.py"),
    ]


def test_an_old_top_level_name_fails_at_once_naming_the_new_one(tmp_path: Path) -> None:
    code = (
        "import importlib\n"
        f"for name in {SUBPACKAGES!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as e:\n"
        "        print(e)\n"
        "    else:\n"
        "        print(name, 'imported')\n"
    )
    done = _python(code, path=REPO_ROOT, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(SUBPACKAGES), done.stdout
    for name, line in zip(SUBPACKAGES, lines, strict=True):
        assert f"import restartable.{name} instead" in line, line


def test_the_launchers_short_name_is_its_own_command(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "restartable.launch", "--help"],
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m restartable.launch "), done.stdout
