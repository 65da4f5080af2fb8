"""A journal directory is input: a damaged or crafted record ends the report with one line.

Every field of one record of each kind in the README demo's journal is replaced by a value of
the wrong type (or removed); the report and the attribution either use the journal or stop with
``inprocess.report: error: <file>:<line>: ...`` and status 2, never with a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from restartable.inprocess.report import cli

DEMO = Path(__file__).parent / "data" / "demo_journal.jsonl"
_WRONG: list[Any] = ["x", None, [], 1e308, "<removed>"]


def _write(directory: Path, records: list[dict[str, Any]]) -> None:
    files: dict[str, list[str]] = {}
    for r in records:
        files.setdefault(r["_file"], []).append(json.dumps({**r, "_file": None}))
    for name, lines in files.items():
        (directory / name).write_text("\n".join(lines) + "\n")


def _mutations() -> list[tuple[int, str, Any]]:
    records = [json.loads(line) for line in DEMO.read_text().splitlines()]
    first: dict[str, int] = {}
    for i, r in enumerate(records):
        first.setdefault(r["event"], i)
    return [(i, k, v) for i in first.values() for k in records[i] if k != "_file" for v in _WRONG]


def test_every_wrongly_typed_field_ends_the_report_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [json.loads(line) for line in DEMO.read_text().splitlines()]
    refused = 0
    for n, (i, key, value) in enumerate(_mutations()):
        crafted = [dict(r) for r in records]
        if value == "<removed>":
            del crafted[i][key]
        else:
            crafted[i][key] = value
        d = tmp_path / str(n)
        d.mkdir()
        _write(d, crafted)
        for argv in ([str(d)], ["--attribute", str(d)]):
            status = cli.main(argv)  # any exception but a one-line error fails the test here
            err = capsys.readouterr().err
            assert status in (0, 2), (key, value, err)
            if status == 2:
                assert (
                    err.startswith("restartable.inprocess.report: error: ") and err.count("\n") == 1
                ), err
                refused += "rank" in err or ".jsonl:" in err
    assert refused > 0  # the check is exercised: some crafted fields were named
