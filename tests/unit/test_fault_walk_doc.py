"""Issue 45: docs/inprocess.md's dead-rank fault walk names the modules the code passes.

Read from the code, not from a run: every call hop (``A -> B``) of the walk must be a call the
imports allow (``A`` imports ``B``, or for a return ``B`` imports ``A``; a call through a
collaborator passed in says ``(injected by `W`)``, and ``W`` must import ``B``), every module named
must exist, the hops must be numbered in order and the count the section states must be the
number it lists; ``protocol/`` never imports ``restart/`` (no call back up). What it cannot see:
whether a hop the code takes is missing from the list (the walk is still read by a person).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "inprocess.md"
PACKAGE = REPO / "inprocess"
HOP = re.compile(r"^(\d+)\. `([\w/]+\.py)` (->|=>) `([\w/]+\.py)`(.*)$", re.MULTILINE)
# A call through a collaborator passed in (``A`` does not import ``B``) names who wires it.
INJECTED = re.compile(r"\(injected by `([\w/]+\.py)`\)")


def _walk_section() -> str:
    return DOC.read_text().split("## The fault walk", 1)[1].split("\n## ", 1)[0]


def _hops() -> list[tuple[int, str, str, str, str]]:
    return [(int(n), a, arrow, b, rest) for n, a, arrow, b, rest in HOP.findall(_walk_section())]


def _dotted(module: str) -> str:
    """``restart/loop.py`` -> ``restartable.inprocess.restart.loop``."""
    return "restartable.inprocess." + module.removesuffix(".py").replace("/", ".")


def _imports(module: str) -> set[str]:
    """Every module ``module`` imports, anywhere in it (a ``from x import y`` counts both ``x``
    and ``x.y``: ``y`` may be a module)."""
    tree = ast.parse((PACKAGE / module).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_the_walk_is_numbered_and_its_count_is_the_one_stated() -> None:
    hops = _hops()
    assert [h[0] for h in hops] == list(range(1, len(hops) + 1)), hops
    stated = re.search(r"^(\d+) hops over", _walk_section(), re.MULTILINE)
    assert stated is not None, "the section states its count as 'N hops over ...'"
    assert int(stated.group(1)) == len(hops)


def test_every_call_hop_of_the_walk_is_a_call_the_imports_allow() -> None:
    wrong = []
    for n, a, arrow, b, rest in _hops():
        assert (PACKAGE / a).is_file() and (PACKAGE / b).is_file(), f"hop {n}: {a} {arrow} {b}"
        if arrow == "=>" or _dotted(b) in _imports(a) or _dotted(a) in _imports(b):
            continue
        wiring = INJECTED.search(rest)
        if wiring is None or _dotted(b) not in _imports(wiring.group(1)):
            wrong.append(f"hop {n}: {a} -> {b}: neither imports the other, nor is it injected")
    assert not wrong, "\n".join(wrong)


def test_the_protocol_never_calls_back_up_into_the_restart_loop() -> None:
    up = {
        p.name: sorted(
            i
            for i in _imports(f"protocol/{p.name}")
            if i.startswith("restartable.inprocess.restart")
        )
        for p in (PACKAGE / "protocol").glob("*.py")
    }
    assert {m: i for m, i in up.items() if i} == {}
