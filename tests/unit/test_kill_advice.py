"""Issue 47: a job that replaces killed ranks but keeps their checkpoints in memory only is
warned once at start, with the fix (inprocess.restart.advice)."""

from __future__ import annotations

import logging

import pytest

from restartable.checkpoint.config import LocalConfig, PersistentConfig, tiers_record
from restartable.inprocess.restart.advice import KillAdvice, advice

PERSISTENT = PersistentConfig(root="/tmp/x", every=20)


def test_memory_only_is_advised_and_a_surviving_copy_is_not() -> None:
    text = advice(tiers_record(LocalConfig(every=1), PERSISTENT), replaces="1 warm reserve")
    assert text is not None
    assert "this job replaces a killed rank (1 warm reserve)" in text
    assert "persistent_every=20" in text and "local_dir='/dev/shm/<job>/ckpt'" in text
    assert advice(tiers_record(LocalConfig(dir="/dev/shm/c"), PERSISTENT), replaces="r") is None
    two = LocalConfig(replication_factor=2)
    assert advice(tiers_record(two, PERSISTENT), replaces="r") is None
    assert advice(tiers_record(None, PERSISTENT), replaces="r") is None


def test_the_managers_record_is_heard_once_and_only_where_kills_are_replaced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    channel = logging.getLogger("restartable.journal")
    fields = tiers_record(LocalConfig(every=1), PERSISTENT)
    with caplog.at_level(logging.WARNING, logger="restartable.inprocess.restart.advice"):
        quiet = KillAdvice()
        quiet.start(reserves=0, max_respawns=0)  # nothing replaces a killed rank: no advice
        channel.debug("tiers", extra={"journal": fields})
        told = KillAdvice()
        told.start(reserves=0, max_respawns=2)
        channel.debug("tiers", extra={"journal": fields})
        channel.debug("tiers", extra={"journal": fields})  # a second manager: said already
        told.stop()
    lines = [
        r.getMessage() for r in caplog.records if r.name == "restartable.inprocess.restart.advice"
    ]
    assert len(lines) == 1 and "(--max-respawns 2)" in lines[0], lines
    assert not channel.handlers
