"""The README's quick start (two commands after the CPU note, the same as CI's) and its index of
docs/ (every page), and links into docs/ that name pages that exist."""

from __future__ import annotations

import re
from pathlib import Path

from tests.doc_commands import REPO_ROOT, doc_files, fenced_commands


def test_the_readme_index_lists_every_docs_page() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    index = readme.split("## Documentation", 1)[1]
    listed = set(re.findall(r"^- \[docs/([\w.-]+\.md)\]\(docs/\1\)", index, flags=re.M))
    pages = {p.name for p in (REPO_ROOT / "docs").glob("*.md")}
    assert listed == pages


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, - for
    spaces); headings inside fenced blocks are code, not headings."""
    anchors: set[str] = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if line.strip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"^#{1,6} (.*)$", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def test_every_link_to_a_docs_page_names_one_that_exists_and_its_section() -> None:
    broken: list[str] = []
    for path in doc_files():
        text = path.read_text()
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?(?:#([\w-]+))?\)", text):
            page = (path.parent / target).resolve() if target else path
            if not page.is_file():
                broken.append(f"{path.relative_to(REPO_ROOT)}: {target}")
            elif anchor and anchor not in _anchors(page):
                broken.append(f"{path.relative_to(REPO_ROOT)}: {target}#{anchor}")
    assert broken == []


def test_the_quick_start_is_two_commands_after_the_cpu_note_and_ci_runs_the_same() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n##", 1)[0]
    commands = [c for c in fenced_commands(REPO_ROOT / "README.md") if c.text in quick]
    assert len(commands) == 2, commands
    install_run, tests = commands
    # The CPU note comes before the command that would download the CUDA build.
    assert quick.index("download.pytorch.org/whl/cpu") < quick.index(install_run.text)
    # CI installs as the quick start does and runs its test command.
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "pip install --quiet torch==2.13.0" in ci and "torch==2.13.0" in install_run.text
    assert tests.text.endswith("&& python -m pytest -q") and "\npython -m pytest -q\n" in ci + "\n"
