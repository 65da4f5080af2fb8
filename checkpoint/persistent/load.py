"""The persistent tier's load path: choose a committed checkpoint, verify it, check the keys, load.

COLLECTIVE over the dedicated group: every rank calls ``load_latest`` / ``load_step`` together.
Rank 0's listing is broadcast so all ranks consider the same candidates; checksum verification
is split across ranks (file i is read by rank i mod world) and its outcome all-gathered, so a
corrupt file is detected once and every rank takes the same decision.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from restartable.checkpoint import _torch_private
from restartable.checkpoint.collectives import all_gather, broadcast, rank_and_size
from restartable.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
)
from restartable.checkpoint.persistent.integrity import verify_files
from restartable.checkpoint.persistent.layout import CheckpointDirs, Committed
from restartable.checkpoint.persistent.safe_reader import SafeLoadPlanner, UnsafeCheckpointError
from restartable.checkpoint.persistent.staging import expand_stateful
from restartable.checkpoint.persistent.storage import make_reader

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)


def list_committed(dirs: CheckpointDirs, group: ProcessGroup | None) -> list[Committed]:
    """Committed checkpoints as rank 0 sees them, on every rank (oldest first)."""
    rank, _ = rank_and_size(group)
    mine = dirs.list_committed() if rank == 0 else None
    result: list[Committed] = broadcast(mine, group)
    return result


def verify(dirs: CheckpointDirs, ckpt: Committed, group: ProcessGroup | None) -> list[str]:
    """Problems found in ``ckpt``'s files by any rank (empty: all checksums match)."""
    rank, world = rank_and_size(group)
    names = sorted(ckpt.files)
    try:
        mine = verify_files(
            dirs.fs, lambda n: dirs.join_dir(ckpt.path, n), ckpt.files, names[rank::world]
        )
    except Exception as e:
        mine = [f"{ckpt.path}: verification failed on rank {rank}: {e}"]
    return [p for problems in all_gather(mine, group) for p in problems]


def _mismatches(state: dict[str, Any], metadata: Any) -> list[str]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = _torch_private.flatten_state_dict(expand_stateful(state))
    stored = metadata.state_dict_metadata
    problems = []
    for key, value in flat.items():
        if key not in stored:
            problems.append(f"{key}: not in the checkpoint")
            continue
        meta = stored[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(meta, TensorStorageMetadata):
                problems.append(f"{key}: a tensor here, not a tensor in the checkpoint")
            elif tuple(value.shape) != tuple(meta.size):
                problems.append(
                    f"{key}: shape {tuple(value.shape)} here, {tuple(meta.size)} in the checkpoint"
                )
    return problems


def _check_metadata(reader: Any, state: dict[str, Any], group: ProcessGroup | None) -> list[str]:
    """Every rank's key/shape problems against ``reader``'s metadata. Raises
    ``UnsafeCheckpointError`` on every rank when any rank's metadata was refused as not data."""
    refused = ""
    try:
        problems = _mismatches(state, reader.read_metadata())
    except UnsafeCheckpointError as e:
        problems, refused = [], str(e)
    except Exception as e:
        problems = [f"<reading metadata>: {type(e).__name__}: {e}"]
    gathered = all_gather([refused, problems], group)
    refusals = sorted({r for r, _ in gathered if r})
    if refusals:
        raise UnsafeCheckpointError(refusals[0], path=refusals[0].split(":", 1)[0])
    return [p for _, ps in gathered for p in ps]


def _refusal_in(e: BaseException) -> UnsafeCheckpointError | None:
    """The ``UnsafeCheckpointError`` among a DCP ``CheckpointException``'s rank failures."""
    for failure in dict(getattr(e, "failures", {}) or {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, UnsafeCheckpointError):
            return exc
    return e if isinstance(e, UnsafeCheckpointError) else None


def load_one(
    dirs: CheckpointDirs, ckpt: Committed, state: dict[str, Any], group: ProcessGroup | None
) -> None:
    """Fill ``state`` in place from ``ckpt`` (already verified). Raises on key/shape mismatch,
    and ``UnsafeCheckpointError`` (on every rank) when a file of it is not plain data."""
    import torch.distributed.checkpoint as dcp

    reader = make_reader(dirs, ckpt.path)
    lines = sorted(set(_check_metadata(reader, state, group)))
    if lines:
        keys = sorted({p.split(":", 1)[0] for p in lines})
        raise CheckpointMismatchError(
            f"state does not match checkpoint {ckpt.path} (step {ckpt.step}) at "
            f"{len(keys)} key(s):\n  " + "\n  ".join(lines) + "\nload into a state with the "
            "same structure as the saved one (same model/optimizer configuration)",
            keys=keys,
        )
    try:
        dcp.load(
            state,
            storage_reader=reader,
            planner=SafeLoadPlanner(),
            process_group=group,
            no_dist=group is None,
        )
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        refusal = _refusal_in(e)
        if refusal is not None:
            raise UnsafeCheckpointError(f"{ckpt.path}: {refusal}", path=ckpt.path) from e
        raise CheckpointError(f"loading {ckpt.path} failed: {type(e).__name__}: {e}") from e


def load_latest(
    dirs: CheckpointDirs,
    state: dict[str, Any],
    group: ProcessGroup | None,
    *,
    fallback_on_corruption: bool,
    min_step: int | None = None,
    max_step: int | None = None,
) -> Committed | None:
    """Load the newest committed checkpoint that verifies (of a step up to ``max_step``, if
    given: a newer one is distrusted, see ``checkpoint.quarantine``); None if there is none.

    A corrupt newest checkpoint, or one holding a file that is not plain data (a crafted
    ``.metadata`` whose checksums were fixed up), is skipped with a WARNING (or raises, without
    fallback). When every candidate is corrupt, raises ``CheckpointCorruptError`` (never
    silently starts over).
    """
    candidates = _between(list_committed(dirs, group), min_step, max_step)
    corrupt: list[str] = []
    for ckpt in reversed(candidates):
        t0 = time.perf_counter()
        problems = verify(dirs, ckpt, group)
        if problems:
            msg = f"checkpoint of step {ckpt.step} is corrupt: " + "; ".join(problems)
            if not fallback_on_corruption:
                raise CheckpointCorruptError(msg, path=problems[0].split(":", 1)[0])
            log.warning("%s; falling back to the previous committed checkpoint", msg)
            corrupt.append(msg)
            continue
        try:
            load_one(dirs, ckpt, state, group)
        except UnsafeCheckpointError as e:  # the same decision on every rank (load_one)
            msg = f"checkpoint of step {ckpt.step} is refused: {e}"
            if not fallback_on_corruption:
                raise
            log.warning("%s; falling back to the previous committed checkpoint", msg)
            corrupt.append(msg)
            continue
        log.info(
            "checkpoint: loaded step %d from %s in %.2f s",
            ckpt.step,
            ckpt.path,
            time.perf_counter() - t0,
        )
        return ckpt
    if corrupt:
        raise CheckpointCorruptError(
            "every committed checkpoint is corrupt: " + " | ".join(corrupt), path=dirs.url
        )
    return None


def _between(found: list[Committed], low: int | None, high: int | None) -> list[Committed]:
    """The checkpoints of ``found`` whose step is in [low, high] (None: unbounded)."""
    return [c for c in found if (low is None or c.step >= low) and (high is None or c.step <= high)]
