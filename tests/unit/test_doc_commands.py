"""The commands README.md and docs/ show name files, modules, flags and extras that exist, carry
only the markers tests/doc_commands.py defines, and start a new run in a directory of their own.

Static and fast (no command runs here); tests/dist/test_doc_commands_run.py runs them.
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

from tests import doc_commands
from tests.doc_commands import NEEDS, REPO_ROOT, Command

COMMANDS = doc_commands.all_commands()
FENCED = [c for c in COMMANDS if c.fenced]
# Words of a synopsis (`python -m restartable.launch --nproc-per-node N train.py`): the user's own
# script and the placeholders for values; flags after the user's script are that script's.
USER_SCRIPTS = ("train.py", "script.py", "SCRIPT")


@cache
def _sources(folder: Path) -> str:
    """Every .py file of a folder, as one text: where its command-line flags are spelt."""
    return "\n".join(p.read_text() for p in sorted(folder.glob("*.py")))


@cache
def _extras() -> frozenset[str]:
    """The extras pyproject.toml declares (read by hand: tomllib is not in Python 3.10)."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return frozenset(re.findall(r"^([A-Za-z0-9_-]+) = \[", section, flags=re.M))


def _conftest_flags() -> str:
    return "\n".join(p.read_text() for p in sorted((REPO_ROOT / "tests").rglob("conftest.py")))


# A command's short name and the module whose flags it takes (restartable/launch.py).
_SHORT_NAMES = {"restartable.launch": "restartable.inprocess.launch"}


def _flag(token: str) -> str | None:
    """``--name`` of a token such as ``--name=value`` or ``[--name``; None for anything else."""
    token = token.strip("[]")
    return token.split("=")[0] if token.startswith("--") else None


def _python_problems(argv: list[str]) -> list[str]:
    """What in ``python ARGV`` names a module, script or flag that does not exist."""
    if not argv or argv[0] in ("-c", "-S", "-X"):
        return []
    problems: list[str] = []
    if argv[0] == "-m":
        module, rest = argv[1], argv[2:]
        module = _SHORT_NAMES.get(module, module)
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            return [f"no module {module}"]
        if module == "pytest":
            return _pytest_problems(rest)
        owner: Path | None = Path(spec.origin).parent
    else:
        owner, rest = None, argv
    for token in rest:
        if token.endswith((".py", ".sbatch")):
            if (REPO_ROOT / token).is_file():
                owner = (REPO_ROOT / token).parent
            elif token in USER_SCRIPTS:
                owner = None  # the user's script: its flags are its own
            else:
                problems.append(f"no file {token}")
            continue
        flag = _flag(token)
        if flag and flag != "--help" and owner is not None and f'"{flag}"' not in _sources(owner):
            problems.append(f"{flag} is no option of {owner.relative_to(REPO_ROOT)}")
    return problems


def _pytest_problems(argv: list[str]) -> list[str]:
    problems: list[str] = []
    after_k = False
    for token in argv:
        if after_k:
            after_k = False
        elif token == "-k":
            after_k = True
        elif (flag := _flag(token)) is not None:
            if f'"{flag}"' not in _conftest_flags():
                problems.append(f"{flag} is no option of the tests' conftest.py files")
        elif not token.startswith("-") and not (REPO_ROOT / token.split("::")[0]).exists():
            problems.append(f"no test path {token}")
    return problems


def _pip_problems(argv: list[str]) -> list[str]:
    problems: list[str] = []
    for i, token in enumerate(argv):
        if token == "-c" and not (REPO_ROOT / argv[i + 1]).is_file():
            problems.append(f"no constraints file {argv[i + 1]}")
        if token.startswith(".[") and token.endswith("]"):
            problems += [f"no extra {e}" for e in token[2:-1].split(",") if e not in _extras()]
    return problems


def problems(command: Command) -> list[str]:
    """What in one command (every part of an ``&&`` chain) does not exist in this checkout."""
    found: list[str] = []
    for argv in command.parts():
        while argv and "=" in argv[0] and argv[0].split("=")[0].isupper():
            argv = argv[1:]  # VAR=value before the program
        program, rest = argv[0], argv[1:]
        if program == "python":
            found += _python_problems(rest)
        elif program == "pip":
            found += _pip_problems(rest)
        elif program == "sbatch":
            found += [f"no file {t}" for t in rest if t.endswith(".sbatch")
                      and not (REPO_ROOT / t).is_file()]  # fmt: skip
        elif program not in ("apt-get", "srun", "export"):
            found.append(f"unknown program {program}")
    return found


@pytest.mark.parametrize("path", doc_commands.doc_files(), ids=lambda p: p.name)
def test_no_command_hides_in_an_indented_block(path: Path) -> None:
    # Only fenced blocks are checked and run: an indented block's command would escape both.
    assert doc_commands.indented_commands(path) == []


def test_each_fenced_command_runs_here_or_says_what_it_needs() -> None:
    assert len(FENCED) >= 20, [c.where for c in FENCED]  # the parser found the docs' blocks
    unknown = [(c.where, c.needs) for c in FENCED if c.needs and not c.needs.startswith(NEEDS)]
    assert unknown == [], f"a marker names none of {NEEDS}"
    # The quick start, the template and a docs command run as pasted; a Slurm one is marked.
    runs = {c.text for c in FENCED if c.needs is None}
    assert (
        "python -m restartable.launch --nproc-per-node 3 examples/minimal.py --fail-at 30" in runs
    )
    assert any("--run-dir runs/timeouts" in t for t in runs), runs
    assert all(c.needs for c in FENCED if c.text.startswith("sbatch")), FENCED


def test_every_command_names_files_modules_flags_and_extras_that_exist() -> None:
    found = [f"{c.where}: {p}  [{c.text}]" for c in COMMANDS for p in problems(c)]
    assert found == [], "\n".join(found)


def test_a_command_that_starts_a_new_run_uses_a_directory_of_its_own() -> None:
    # The example refuses to redo a finished run ("nothing to do", status 0): a second command
    # with another plan in the same directory would silently run nothing. The same command
    # twice is fine (it resumes or says it finished); --fresh starts over on purpose.
    defaults = {"examples/train.py": ("--run-dir", "runs/example"),
                "examples/minimal.py": ("--ckpt", "runs/minimal")}  # fmt: skip
    owner: dict[str, Command] = {}
    clashes: list[str] = []
    for c in FENCED:
        for argv in c.parts():
            script = next((t for t in argv if t in defaults), None)
            if script is None or "--fresh" in argv:
                continue
            option, directory = defaults[script]
            if option in argv:
                directory = argv[argv.index(option) + 1]
            first = owner.setdefault(directory, c)
            if first.text != c.text:
                clashes.append(f"{c.where} runs in {directory}, as {first.where} does")
    assert clashes == []
    assert len(owner) >= 4, owner  # the quick start, minimal.py and docs runs were all seen
