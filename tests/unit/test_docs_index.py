"""The README's documentation index lists every page of docs/, and every link into docs/ from
README.md and docs/*.md names a page that exists."""

from __future__ import annotations

import re

from tests.doc_commands import REPO_ROOT, doc_files


def test_the_readme_index_lists_every_docs_page() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    index = readme.split("## Documentation", 1)[1]
    listed = set(re.findall(r"^- \[docs/([\w.-]+\.md)\]\(docs/\1\)", index, flags=re.M))
    pages = {p.name for p in (REPO_ROOT / "docs").glob("*.md")}
    assert listed == pages


def test_every_link_to_a_docs_page_names_one_that_exists() -> None:
    broken: list[str] = []
    for path in doc_files():
        for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", path.read_text()):
            if not (path.parent / target).resolve().is_file():
                broken.append(f"{path.relative_to(REPO_ROOT)}: {target}")
    assert broken == []
