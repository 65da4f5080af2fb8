"""The run journal: what the framework did, one append-only JSONL file per process.

Every package writes to it through one ``logging`` channel, ``restartable.journal``, so that
``checkpoint`` and ``rerun`` need not import ``inprocess`` (the design's import rules): a record
is a log record at DEBUG whose message is the event name and whose ``journal`` attribute holds
the fields::

    logging.getLogger("restartable.journal").debug("save", extra={"journal": {"step": 100}})

Nothing is written unless a journal is open in the process (``open_journal``: the
``@restartable`` wrapper opens one when ``journal_dir`` or ``RESTARTABLE_JOURNAL_DIR`` names a
directory). While none is open the channel is below its level and a record costs one
``isEnabledFor`` check. While one is open the channel does not propagate, so journal records
never reach the user's log handlers.

Each line: ``{"v": SCHEMA_VERSION, "t": <time.time()>, "event": <name>, "host": ..., "pid":
..., "rank": <initial rank>, "launch": <launch id>, **fields}``, flushed per record (a SIGKILL
loses nothing already written). The events and their fields are listed in docs/journal.md.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

from restartable.checkpoint.private_files import NotPrivateError, open_private, private_dir
from restartable.inprocess import journal_fields
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.protocol import environment

CHANNEL = "restartable.journal"
SCHEMA_VERSION = 1
ENV_DIR = "RESTARTABLE_JOURNAL_DIR"
ENV_LAUNCH = environment.ENV_LAUNCH  # set by a launcher: groups one launch's files

_log = logging.getLogger(CHANNEL)
_warn = logging.getLogger(__name__)  # the user's log: what went wrong with the journal itself


def listen(handler: logging.Handler) -> None:
    """Let ``handler`` see the channel's records (a checkpoint restore, ...) whether or not a
    journal is open; the channel then does not propagate (see ``enabled``). Undo with
    ``unlisten``. Used by the restart story (``inprocess.restart.story``)."""
    _log.addHandler(handler)
    _log.setLevel(logging.DEBUG)
    _log.propagate = False


def unlisten(handler: logging.Handler) -> None:
    """Remove a handler added by ``listen``; the channel is reset once no handler is left."""
    _log.removeHandler(handler)
    if not _log.handlers:
        _log.setLevel(logging.NOTSET)
        _log.propagate = True


def _journal_open() -> bool:
    return any(isinstance(h, _Handler) for h in _log.handlers)


def enabled() -> bool:
    """True while a journal is open in this process (cheap; check before building fields).

    The test is the channel's own handler, not its level: with the root logger at DEBUG a
    level test would pass and send journal records into the user's log.
    """
    return _journal_open()


def record(event: str, **fields: Any) -> None:
    """Append ``event`` with ``fields`` (JSON-serialisable) to this process's journal, if open.

    Straight to the journal's handler, without a ``LogRecord``: this runs at every step. A
    listener (``listen``) gets a ``LogRecord``; the restart story listens only between a restart
    and its console line, so steps pay for it at most once per restart.
    """
    for handler in _log.handlers:
        if isinstance(handler, _Handler):
            handler.write(handler.clock.wall(), event, fields)
        else:
            rec = _log.makeRecord(_log.name, logging.DEBUG, __file__, 0, event, (), None)
            rec.journal = fields
            handler.handle(rec)


class _Handler(logging.Handler):
    """Writes each journal record as one JSON line and flushes it."""

    def __init__(self, stream: TextIO, identity: dict[str, Any], clock: Clock = SYSTEM) -> None:
        super().__init__(level=logging.DEBUG)
        self.clock = clock  # the records' "t" (wall time: other processes compare it)
        self._stream = stream
        self._identity = identity
        # Where this process is now (``Journal.set_position``): stamped on every record, so
        # that packages which know nothing of restarts (checkpoint, rerun) are placed too.
        self.position: dict[str, Any] = {}
        self._write_lock = threading.Lock()  # records come from every thread
        # Set by the first failed write (a full disk: ENOSPC): the journal stops there. Its
        # writers are the fault path, save() and ctx.ping(); none of them may fail for it.
        self.broken: str | None = None

    def emit(self, rec: logging.LogRecord) -> None:
        fields = getattr(rec, "journal", None)
        if fields is not None:  # else a plain log record sent to the channel by mistake
            self.write(rec.created, rec.getMessage(), fields)

    def write(self, t: float, event: str, fields: dict[str, Any]) -> None:
        """One line, flushed (a SIGKILL right after loses nothing)."""
        line = {"v": SCHEMA_VERSION, "t": t, "event": event}
        line.update(self._identity)
        line.update(self.position)
        line.update(fields)
        text = json.dumps(line, default=str) + "\n"
        with self._write_lock:
            if self.broken is not None:
                return
            try:
                self._stream.write(text)
                self._stream.flush()
            except (OSError, ValueError) as exc:  # ValueError: the stream was closed
                self.broken = f"{type(exc).__name__}: {exc}"
        if self.broken is not None:  # outside the lock: the warning may reach a user handler
            _warn.warning(
                "the run journal stopped at %r (%s): training and fault handling go on; the "
                "report will miss what follows",
                event,
                self.broken,
            )

    def close(self) -> None:
        with self._write_lock:
            if not self._stream.closed:
                try:
                    self._stream.close()
                except OSError as exc:  # the last flush: the disk is full
                    self.broken = self.broken or f"{type(exc).__name__}: {exc}"
        super().close()


class Journal:
    """An open journal of this process; ``close()`` it (idempotent) when the job ends.

    Opened by the ``@restartable`` wrapper (or a launcher, a test, a user script) with
    ``open_journal``; at most one per process at a time.
    """

    def __init__(self, path: Path, handler: _Handler) -> None:
        self.path = path
        self._handler = handler

    def set_position(self, *, iteration: int, training_rank: int | None) -> None:
        """The restart iteration this process is in and its rank there (None: a reserve)."""
        self._handler.position = {"iteration": iteration, "training_rank": training_rank}

    def close(self) -> None:
        if self._handler in _log.handlers:
            _log.removeHandler(self._handler)
        if not _log.handlers:
            _log.setLevel(logging.NOTSET)
            _log.propagate = True
        self._handler.close()


def resolve_dir(configured: str | os.PathLike[str] | None) -> Path | None:
    """The journal directory: ``configured``, else ``$RESTARTABLE_JOURNAL_DIR``, else None."""
    value = configured if configured is not None else os.environ.get(ENV_DIR) or None
    return None if value is None else Path(value)


def open_journal(
    directory: str | os.PathLike[str],
    *,
    rank: int,
    launch: str | None = None,
    clock: Clock = SYSTEM,
) -> Journal:
    """Open ``directory/rank<rank>-<host>-<pid>.jsonl`` for appending and start recording.

    ``launch``: the launch id stamped on every record (default ``environment.launch_id()``:
    ``$RESTARTABLE_LAUNCH_ID``, under Slurm one per job attempt; a launcher passes the id it
    gives its ranks). ``clock``: where each record's time (``clock.wall()``) comes from.

    Raises ``ValueError`` naming the directory when it cannot be created or written.
    """
    if _journal_open():
        raise RuntimeError("a journal is already open in this process: close it first")
    d = Path(directory)
    host = socket.gethostname()
    path = d / f"rank{rank}-{host}-{os.getpid()}.jsonl"
    stream = _open_stream(d, path)
    identity = {
        "host": host,
        "pid": os.getpid(),
        "rank": rank,
        "launch": (environment.launch_id() or "") if launch is None else launch,
    }
    handler = _Handler(stream, identity, clock)
    _log.addHandler(handler)
    _log.setLevel(logging.DEBUG)
    _log.propagate = False
    journal = Journal(path, handler)
    # job / attempt: which attempt of which scheduler job this launch is (a requeued Slurm job
    # keeps its id); None outside a scheduler.
    record(
        "process_start",
        argv=sys.argv,
        python=sys.version.split()[0],
        versions=_versions(),
        job=os.environ.get("SLURM_JOB_ID") or None,
        attempt=environment.job_attempt(),
    )
    return journal


def _open_stream(d: Path, path: Path) -> TextIO:
    """``path`` in the journal directory ``d``, opened for appending (``ValueError`` names
    ``d`` when it cannot be created or written)."""
    try:
        private_dir(d, what="journal_dir")  # another user's directory could hold planted links
        fd = open_private(path, os.O_WRONLY | os.O_APPEND, exclusive=False)
        return os.fdopen(fd, "a", encoding="utf-8")  # owned by the handler
    except NotPrivateError as e:
        raise ValueError(f"{e} (or unset {ENV_DIR})") from e
    except OSError as e:
        raise ValueError(
            f"journal_dir ({str(d)!r}) cannot be written: {e}; pass a writable directory or "
            f"unset {ENV_DIR}"
        ) from e


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("torch", "restartable"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = ""
    return out


def read(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record under ``directory`` (recursively), sorted by time. A torn last line (the
    process died mid-write) is skipped; a record of a newer schema raises ``ValueError``."""
    records = []
    for path in sorted(Path(directory).rglob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # only the last line of a killed process can be torn
                if not isinstance(rec, dict) or "event" not in rec:
                    continue  # another tool's JSONL in the same directory
                wrong = "no field 't'" if "t" not in rec else journal_fields.problem(rec)
                if wrong is not None:  # input: one line naming it, not a TypeError later
                    raise ValueError(
                        f"{path}:{n}: {wrong}: not a record of restartable's journal; remove "
                        "the line (or the file)"
                    )
                if rec.get("v", 0) > SCHEMA_VERSION:
                    raise ValueError(
                        f"{path}: journal schema v{rec['v']} is newer than this reader "
                        f"(v{SCHEMA_VERSION}): upgrade restartable"
                    )
                rec["_file"] = path.name
                records.append(rec)
    records.sort(key=lambda r: float(r["t"]))
    return records
