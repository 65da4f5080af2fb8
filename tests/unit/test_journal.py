"""The run journal: records from any package land in one JSONL file per process, only while a
journal is open, never in the user's log; the reader survives a torn last line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from restartable.inprocess import journal


def test_records_from_any_package_go_to_the_file_and_not_to_the_user_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    j = journal.open_journal(tmp_path, rank=3)
    try:
        j.set_position(iteration=2, training_rank=1)
        journal.record("restart", iteration=3, cause="x")
        # What checkpoint/rerun do: the channel by name, no import of inprocess.
        logging.getLogger(journal.CHANNEL).debug("save", extra={"journal": {"step": 7}})
    finally:
        j.close()
    journal.record("after_close")  # no journal open: nothing, no error
    lines = [json.loads(x) for x in j.path.read_text().splitlines()]
    assert [x["event"] for x in lines] == ["process_start", "restart", "save"]
    save = lines[2]
    assert save["v"] == journal.SCHEMA_VERSION and save["rank"] == 3 and save["step"] == 7
    assert save["iteration"] == 2 and save["training_rank"] == 1
    assert lines[1]["iteration"] == 3  # a record's own field wins over the position
    assert not [r for r in caplog.records if r.name == journal.CHANNEL]
    assert not journal.enabled()


def test_reader_skips_a_torn_last_line_and_refuses_a_newer_schema(tmp_path: Path) -> None:
    good = {"v": 1, "t": 2.0, "event": "step", "step": 1}
    (tmp_path / "rank0-h-1.jsonl").write_text(json.dumps(good) + "\n" + '{"v": 1, "t": 3.0, "ev')
    assert [r["event"] for r in journal.read(tmp_path)] == ["step"]
    (tmp_path / "rank1-h-2.jsonl").write_text(json.dumps({**good, "v": 99}) + "\n")
    with pytest.raises(ValueError, match="schema v99 is newer"):
        journal.read(tmp_path)


def test_unwritable_directory_names_it(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"journal_dir .*file.* cannot be written"):
        journal.open_journal(blocker / "sub", rank=0)


def test_directory_from_parameter_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(journal.ENV_DIR, raising=False)
    assert journal.resolve_dir(None) is None
    monkeypatch.setenv(journal.ENV_DIR, "/tmp/env-journal")
    assert journal.resolve_dir(None) == Path("/tmp/env-journal")
    assert journal.resolve_dir("/tmp/param") == Path("/tmp/param")


def test_a_full_disk_stops_the_journal_once_and_never_the_fault_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ENOSPC under the journal (/dev/full) used to raise out of record_fault between the
    fault's append and the end of its iteration: the other ranks were never woken."""
    from restartable.inprocess.errors import FaultRecord
    from restartable.inprocess.protocol import fault_records, iteration_end, keys
    from tests.unit.test_inprocess_store import FakeClock, FakeStore

    handler = journal._Handler(open("/dev/full", "w"), {"rank": 0})  # noqa: SIM115
    journal._log.addHandler(handler)
    jr = journal.Journal(Path("/dev/full"), handler)
    try:
        with caplog.at_level(logging.WARNING, logger="restartable.inprocess.journal"):
            store = FakeStore(FakeClock())
            rec = FaultRecord(iteration=0, initial_rank=1, kind="exception", detail="x", step=3)
            fault_records.record_fault(store, rec)
            journal.record("save", step=4)
        assert (
            iteration_end.outcome(store, 0) == keys.OUTCOME_FAULT
        )  # the fault was still delivered
        warned = [r for r in caplog.records if "journal stopped" in r.getMessage()]
        assert len(warned) == 1 and "No space left" in warned[0].getMessage()
    finally:
        jr.close()
