"""The checkpointed form of a machine's state: the same keys in every state, checked on load.

``capture`` builds ``RerunStateMachine.state_dict()``; ``load_state_dict`` calls ``decode``, then
``resumable`` for a pending re-run. Pure but for the rank / world size they read.
"""

from __future__ import annotations

import io
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from restartable.rerun import agree, persist_fields
from restartable.rerun.errors import RerunConfigError
from restartable.rerun.record import Rejected, StepRecord
from restartable.rerun.replay import StepReplay
from restartable.rerun.rng import RngSnapshot, safe_load
from restartable.rerun.state_machine import RerunMode, State, persisted_state

logger = logging.getLogger(__name__)

STATE_DICT_VERSION = 1

_KEYS = (
    "version",
    "mode",
    "state",
    "iteration",
    "rank",
    "world_size",
    "hardware_id",
    "failed_message",
    "failed_seq",
    "failed_fatal",
    "failed_tolerance",
    "initial_result",
    "suspect_hardware",
    "faulty_hardware",
    "large_values",
    "injector",
    "rng",
    "data",
)


@dataclass
class Persisted:
    """Everything a fresh process needs to continue, including a pending re-run elsewhere."""

    mode: str
    state: State  # IDLE or WILL_RERUN_ELSEWHERE (see state_machine.persisted_state)
    iteration: int
    rank: int
    world_size: int
    hardware_id: str
    rejected: Rejected | None  # the call to compare on the other hardware (suspect rank only)
    suspect_hw: str
    faulty_hardware: list[str]
    large_values: dict[str, list[float]]
    injector: dict[str, Any]
    rng: RngSnapshot | None  # the step's RNG snapshot when a re-run is pending
    data: list[list[Any]] | None  # the step's microbatches per data iterator, likewise


def capture(
    *,
    mode: str,
    state: State,
    iteration: int,
    hardware_id: str,
    rec: StepRecord,
    faulty_hardware: list[str],
    large_values: dict[str, list[float]],
    injector: dict[str, Any],
    replay: StepReplay,
) -> dict[str, Any]:
    """``RerunStateMachine.state_dict()``'s value for a machine in ``state`` (between steps):
    the pending re-run's call, RNG snapshot and microbatches only when one is pending."""
    rank, world = agree.rank_and_world()
    saved = persisted_state(state)
    pending = saved is State.WILL_RERUN_ELSEWHERE
    data = replay.data() if pending else None
    r = rec.rejected if pending else None
    return encode(
        Persisted(
            mode=mode,
            state=saved,
            iteration=iteration,
            rank=rank,
            world_size=world,
            hardware_id=hardware_id,
            rejected=r,
            suspect_hw=rec.suspect_hw if r else "",
            faulty_hardware=faulty_hardware,
            large_values=large_values,
            injector=injector,
            rng=replay.snapshot if pending else None,
            data=data,
        )
    )


def resumable(p: Persisted, *, mode: RerunMode, iteration: int) -> bool:
    """Whether ``p`` holds a pending re-run that resumes in this job: the same world size, and
    a mode that validates results; otherwise one is dropped with a warning, like a resharded
    job."""
    if p.state is not State.WILL_RERUN_ELSEWHERE:
        return False
    world = agree.rank_and_world()[1]
    if p.world_size != world or mode is not RerunMode.VALIDATE_RESULTS:
        logger.warning(
            "iteration %d: a pending re-run from a job with world size %d in mode %s is "
            "ignored (now world size %d, mode %s)",
            iteration,
            p.world_size,
            p.mode,
            world,
            mode.value,
        )
        return False
    return True


def encode(p: Persisted) -> dict[str, Any]:
    """Plain values only (str, int, float, bool, bytes); blobs are empty when nothing is pending."""
    r = p.rejected
    data = b""
    if p.data is not None:
        buf = io.BytesIO()
        torch.save(p.data, buf)
        data = buf.getvalue()
    return {
        "version": STATE_DICT_VERSION,
        "mode": p.mode,
        "state": p.state.value,
        "iteration": p.iteration,
        "rank": p.rank,
        "world_size": p.world_size,
        "hardware_id": p.hardware_id,
        "failed_message": r.message if r else "",
        "failed_seq": r.seq if r else -1,
        "failed_fatal": r.fatal if r else True,
        "failed_tolerance": r.tolerance if r else 0.0,
        "initial_result": r.initial if r else math.nan,
        "suspect_hardware": p.suspect_hw,
        "faulty_hardware": json.dumps(p.faulty_hardware),
        "large_values": json.dumps(p.large_values),
        "injector": json.dumps(p.injector),
        "rng": p.rng.to_bytes() if p.rng is not None else b"",
        "data": data,
    }


def decode(sd: Mapping[str, Any]) -> Persisted:
    """Parse ``encode``'s output; a foreign or incompatible dict fails with the fix."""
    missing = [k for k in _KEYS if k not in sd]
    if missing:
        raise RerunConfigError(
            f"state_dict is missing {missing[0]!r}: pass the dict returned by "
            "RerunStateMachine.state_dict()"
        )
    if sd["version"] != STATE_DICT_VERSION:
        raise RerunConfigError(
            f"state_dict version ({sd['version']}) must be {STATE_DICT_VERSION}: "
            "it was written by another version of rerun"
        )
    persist_fields.check(sd)  # input: every field holds what encode writes, or one clear error
    rejected = None
    if sd["failed_message"]:
        rejected = Rejected(
            str(sd["failed_message"]),
            int(sd["failed_seq"]),
            bool(sd["failed_fatal"]),
            float(sd["failed_tolerance"]),
            float(sd["initial_result"]),
        )
    return Persisted(
        mode=str(sd["mode"]),
        state=State(sd["state"]),
        iteration=int(sd["iteration"]),
        rank=int(sd["rank"]),
        world_size=int(sd["world_size"]),
        hardware_id=str(sd["hardware_id"]),
        rejected=rejected,
        suspect_hw=str(sd["suspect_hardware"]),
        faulty_hardware=list(json.loads(sd["faulty_hardware"])),
        large_values=json.loads(sd["large_values"]),
        injector=json.loads(sd["injector"]),
        rng=_plain(RngSnapshot.from_bytes, sd["rng"], "rng") if sd["rng"] else None,
        data=persist_fields.check_data(_plain(safe_load, sd["data"], "data"))
        if sd["data"]
        else None,
    )


def _plain(load: Any, data: bytes, field: str) -> Any:
    """``load(data)`` (a weights-only torch.load: no code runs from a checkpoint), or a
    ``RerunConfigError`` naming the field when the bytes hold anything else."""
    try:
        return load(data)
    except Exception as exc:
        reason = next((ln for ln in str(exc).splitlines() if "WeightsUnpickler" in ln), "")
        raise RerunConfigError(
            f"state_dict[{field!r}] holds objects that are not plain data ({reason.strip() or exc}"
            "): refused unread; it was not written by RerunStateMachine.state_dict()"
        ) from None
