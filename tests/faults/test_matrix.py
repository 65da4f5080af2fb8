"""The fault matrix (see tests/faults/matrix.py): every row must end as its row says.

``pytest tests/faults`` plays the CI subset; ``pytest tests/faults --matrix=full`` every row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.faults import matrix


@pytest.fixture(scope="module")
def clean_params(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The final parameters of the job without a fault (what every finished row must reach)."""
    out = matrix.play(matrix.Row("none", "none", -1), tmp_path_factory.mktemp("clean"))
    assert out.returncode == 0, out.output
    finals = [e["result"]["params"] for e in out.ends.values() if matrix._finished(e)]
    assert len(finals) == 2 and finals[0] == finals[1], json.dumps(out.ends)[:2000]
    return finals[0]


def test_row(row: matrix.Row, clean_params: list[float], tmp_path: Path, record_row: Any) -> None:
    out = matrix.play(row, tmp_path)
    problems = matrix.check(out, clean_params, tmp_path / "run")
    record_row(out, problems)
    assert not problems, "\n".join(problems) + "\n" + out.output[-6000:]
