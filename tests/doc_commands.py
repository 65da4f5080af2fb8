"""The shell commands that README.md and docs/*.md show a user, parsed for the tests that check
and run them (tests/unit/test_doc_commands.py, tests/dist/test_doc_commands_run.py).

A command is a line of a fenced ``bash`` (``sh``, ``shell``) block, with its ``\\`` continuation
lines, or an inline code span that starts with ``python``. Every fenced command either runs as
pasted on a machine where the README's quick start ran, or carries a marker that says what else
it needs, as a comment on its line or as the first line of its block (then for the whole block):

    # needs a cluster          more machines: several etcd members, a Slurm cluster, srun
    # needs a GPU              CUDA
    # needs your script        a template that names the user's own train.py
    # needs pip install ...    a package the quick start does not install (the command follows)

Nothing else marks a command, so a command that fails to run cannot be hidden by a comment.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHELL_FENCES = ("bash", "sh", "shell")
# The reasons a command may not run on the quick start's machine (see the module docstring).
NEEDS = ("a cluster", "a GPU", "your script", "pip install ")
_NEEDS_RE = re.compile(r"#\s*needs (.+)$")
_INLINE_RE = re.compile(r"`((?:[A-Z_]+=\S+ )*python [^`]+)`")
# A command in an indented (unfenced) code block: such blocks escape the checks, so none may be.
_INDENTED_RE = re.compile(r"^ {4}(?:[A-Z_]+=\S+ )*(?:python|pip|sbatch|srun|apt-get|torchrun) ")


@dataclass(frozen=True)
class Command:
    """One command as a user would paste it, with where it is shown and what it needs."""

    where: str  # "docs/etcd.md:26"
    text: str  # continuation lines joined, the trailing comment removed
    needs: str | None  # the marker's reason, or None: it runs as pasted
    fenced: bool  # False: an inline code span (checked, never run)

    def parts(self) -> list[list[str]]:
        """The ``&&``-separated commands, each split as the shell splits it."""
        return [shlex.split(p) for p in self.text.split("&&")]


def doc_files() -> list[Path]:
    """README.md, then every page of docs/ in name order: the order a newcomer reads them."""
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO_ROOT).as_posix()}:{line}"


def _needs(comment_line: str) -> str | None:
    m = _NEEDS_RE.search(comment_line)
    return m.group(1).strip() if m else None


def _strip_comment(line: str) -> str:
    """The command without its trailing ``# ...`` comment (a ``#`` inside quotes stays)."""
    for m in re.finditer(r"\s#", line):
        head = line[: m.start()]
        if head.count('"') % 2 == 0 and head.count("'") % 2 == 0:
            return head.strip()
    return line.strip()


def fenced_commands(path: Path) -> list[Command]:
    """The commands of the fenced shell blocks of one Markdown file, in order."""
    commands: list[Command] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if not fence.startswith("```"):
            i += 1
            continue
        lang = fence[3:].strip().split(" ")[0]
        i += 1
        block_needs: str | None = None
        first = True
        while i < len(lines) and not lines[i].strip().startswith("```"):
            start = i
            raw = lines[i]
            while raw.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                raw = raw.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            stripped = raw.strip()
            if lang not in SHELL_FENCES or not stripped:
                continue
            if stripped.startswith("#"):
                if first:
                    block_needs = _needs(stripped)
                first = False
                continue
            first = False
            text = _strip_comment(stripped)
            needs = _needs(stripped[len(text) :]) or block_needs
            commands.append(Command(_where(path, start + 1), text, needs, fenced=True))
        i += 1  # the closing fence
    return commands


def inline_commands(path: Path) -> list[Command]:
    """The ``python ...`` code spans of the prose and tables of one Markdown file."""
    found: list[Command] = []
    in_fence = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for m in _INLINE_RE.finditer(line):
            found.append(Command(_where(path, n), m.group(1).strip(), None, fenced=False))
    return found


def indented_commands(path: Path) -> list[str]:
    """Where a command sits in an indented code block instead of a fenced one."""
    found: list[str] = []
    in_fence = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence and _INDENTED_RE.match(line):
            found.append(f"{_where(path, n)}: {line.strip()}")
    return found


def all_commands() -> list[Command]:
    """Every fenced, then every inline command of README.md and docs/*.md."""
    files = doc_files()
    return [c for f in files for c in fenced_commands(f)] + [
        c for f in files for c in inline_commands(f)
    ]
