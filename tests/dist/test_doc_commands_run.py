"""Every fenced command of README.md and docs/ that carries no "# needs ..." marker runs as
pasted and exits 0, in README-then-docs order, in one directory where the quick start ran first;
each command that keeps state in that directory (the examples, the report) runs twice in a row,
as a user repeats a command. tests/unit/test_doc_commands.py checks the rest statically.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import doc_commands
from tests.doc_commands import REPO_ROOT
from tests.multiproc import run_job, slow

# Installs (the quick start's pip, etcd.md's apt-get) changed the machine once already and are
# checked statically; `python -m pytest` commands are the suite itself.
_NOT_RUN = (["pip"], ["apt-get"], ["python", "-m", "pytest"])
# What a command may read or write in the user's checkout; docs/ is a directory of its own, so
# that scale.md's `--png docs/restart_scale.png` does not overwrite the repository's figure.
_LINKED = ("examples", "benchmarks", "tests", ".ci", "pyproject.toml")
_DEADLINE_S = 300.0  # the 5-fault demo takes ~30 s on 2 quiet cores, 60-90 s under load


def _short(argv: list[str]) -> list[str]:
    """The command with a short run: a benchmark that has ``--quick`` runs with it (the
    figures' full runs take up to an hour); everything else as pasted."""
    script = next((t for t in argv if t.startswith("benchmarks/")), None)
    if script and '"--quick"' in (REPO_ROOT / script).read_text() and "--quick" not in argv:
        return [*argv, "--quick"]
    return argv


def _split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    env: dict[str, str] = {}
    while argv and "=" in argv[0] and argv[0].split("=")[0].isupper():
        name, value = argv[0].split("=", 1)
        env[name] = value
        argv = argv[1:]
    return env, argv


# pytest's 300 s default is one command's deadline here; the whole run took 5-8 min at load 8-15.
@pytest.mark.timeout(1500)
@slow("every command of README.md and docs/, the 5-fault demo and a benchmark included (5-8 min)")
def test_every_unmarked_doc_command_runs_as_pasted_twice_in_a_row(tmp_path: Path) -> None:
    for name in _LINKED:
        (tmp_path / name).symlink_to(REPO_ROOT / name)
    (tmp_path / "docs").mkdir()
    ran: list[str] = []  # each command's text, in the order run
    for command in doc_commands.all_commands():
        if not command.fenced or command.needs:
            continue
        for part in command.parts():
            env, argv = _split_env(part)
            if any(argv[: len(prefix)] == prefix for prefix in _NOT_RUN):
                continue
            assert argv[0] == "python", f"{command.where}: {command.text}"
            argv = _short(argv)
            stateless = any(t.startswith("benchmarks/") for t in argv)
            for attempt in ("first run", "second run")[: 1 if stateless else 2]:
                job = run_job(argv[1:], deadline=_DEADLINE_S, env=env, cwd=tmp_path)
                assert job.returncode == 0, f"{command.where}, {attempt}: {argv}\n{job.output}"
            ran.append(" ".join(argv))
    # The quick start's demo, minimal.py, two reports, two docs' example runs, the benchmark.
    assert len(ran) >= 7, ran
    assert any("examples/minimal.py" in r for r in ran) and any("runs/timeouts" in r for r in ran)
    # The quick start first: the reports read its journal.
    assert ran[0].endswith("examples/train.py --faults demo"), ran
