"""The launcher's part of the run journal (``LauncherJournal``): respawns, in-job restarts and
the exit, next to the ranks' own journals."""

from __future__ import annotations

import logging

from restartable.checkpoint.private_files import private_dir
from restartable.inprocess import journal
from restartable.inprocess.protocol import job_keys
from restartable.inprocess.protocol.store import Store

log = logging.getLogger(__name__)


class LauncherJournal:
    """The launcher's part of the run journal (respawns, in-job restarts, the exit); its file is
    rank-1-... for node 0, rank-2-... for node 1, ...

    In ``$RESTARTABLE_JOURNAL_DIR`` when the environment names one; otherwise in the directory
    the ranks journal to (``RestartConfig.journal_dir``), once they published it in the round's
    store (``job_keys.publish_journal_dir``): a record before that is not kept.
    """

    def __init__(self, node_rank: int) -> None:
        self.rank = -1 - node_rank
        self.launch: str | None = None
        self.jr: journal.Journal | None = None

    def unusable(self) -> str | None:
        """Why the environment's journal directory may not be used (another user owns it or may
        write it: docs/security.md), or None."""
        directory = journal.resolve_dir(None)
        try:
            if directory is not None:
                private_dir(directory, what=journal.ENV_DIR)
        except OSError as exc:
            return str(exc)
        return None

    def start(self, launch: str) -> None:
        """The launch id is known (``JobControl``): open the environment's directory, if any."""
        self.launch = launch
        directory = journal.resolve_dir(None)
        if directory is not None:
            self.jr = journal.open_journal(directory, rank=self.rank, launch=launch)

    def follow(self, store: Store | None) -> None:
        """Open the ranks' directory once they published it (one store look per call until)."""
        if self.jr is not None or store is None or self.launch is None:
            return
        try:
            directory = job_keys.journal_dir(store)
        except Exception as exc:  # the store is gone: the round ends through poll_action
            log.debug("journal directory unreadable: %r", exc)
            return
        if directory is None:
            return
        try:
            self.jr = journal.open_journal(directory, rank=self.rank, launch=self.launch)
        except ValueError as exc:  # not writable from here: the ranks' journals go on alone
            log.warning("the launcher keeps no journal: %s", exc)
            self.launch = None  # stop looking

    def close(self) -> None:
        if self.jr is not None:
            self.jr.close()
            self.jr = None
