"""``--matrix=full`` runs every row of the fault matrix; the default runs ``matrix.SUBSET``.

At the end of the session a table lists each row played, its outcome and the totals (rows,
passes, hangs, lost checkpoints).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.faults import matrix

_RESULTS: list[tuple[matrix.Outcome, list[str]]] = []  # this pytest session's rows, in order


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--matrix",
        choices=("subset", "full"),
        default="subset",
        help="fault matrix rows to run: the CI subset (default) or every row",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "row" in metafunc.fixturenames:
        rows = matrix.full_matrix()
        if metafunc.config.getoption("--matrix") == "subset":
            rows = [r for r in rows if r.id in matrix.SUBSET]
        metafunc.parametrize("row", rows, ids=[r.id for r in rows])


@pytest.fixture
def record_row() -> Any:
    """Called by the matrix test with each row's outcome and problems, for the summary."""
    return lambda outcome, problems: _RESULTS.append((outcome, problems))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _RESULTS:
        return
    tr = terminalreporter
    tr.section("fault matrix")
    for outcome, problems in _RESULTS:
        tr.write_line(outcome.line("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    hangs = sum(o.hung for o, _ in _RESULTS)
    lost = sum(any("fails verification" in p for p in ps) for _, ps in _RESULTS)
    passed = sum(not ps for _, ps in _RESULTS)
    tr.write_line(f"rows {len(_RESULTS)}, passed {passed}, hangs {hangs}, lost checkpoints {lost}")
