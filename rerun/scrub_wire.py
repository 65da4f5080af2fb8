"""What active ranks and reserves exchange for a check, through the job's coordination store.

Why the store, not the process group: a reserve is not a member of the training group, and a
collective would make the active ranks wait for it. A store write is point to point: the
checked rank hands its request to a background thread and goes on; the reserve answers under
its own key, which the rank's sender thread waits for (``rerun.scrub_sender``).

Keys (under ``sdc-scrub/``): ``ready`` (how many reserves serve checks), ``seq`` (the request
counter), ``req/<n>`` (a request: the pre-step parameters, the batch, the RNG state, the rank's
digest), ``claim/<n>`` (the reserve that computes it), ``res/<n>`` (the reserve's digest).
"""

from __future__ import annotations

import datetime
import io
import json
from dataclasses import dataclass
from typing import Any, Protocol

import torch

PREFIX = "sdc-scrub/"
READY_KEY = PREFIX + "ready"
SEQ_KEY = PREFIX + "seq"


def request_key(seq: int) -> str:
    return f"{PREFIX}req/{seq}"


def claim_key(seq: int) -> str:
    return f"{PREFIX}claim/{seq}"


def result_key(seq: int) -> str:
    return f"{PREFIX}res/{seq}"


class ScrubStore(Protocol):
    """The store operations scrubbing uses (a ``torch.distributed.TCPStore`` client has them).
    One client per thread: a TCPStore client serves one call at a time."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def delete_key(self, key: str) -> bool: ...
    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...


@dataclass
class Request:
    """One step of one rank to re-compute: everything a step's result depends on."""

    step: int
    rank: int
    params: dict[str, torch.Tensor]
    batch: Any
    rng: torch.Tensor
    digest: str = ""  # the rank's result; filled in by the sender thread

    def encode(self) -> bytes:
        buf = io.BytesIO()
        torch.save(
            {
                "step": self.step,
                "rank": self.rank,
                "params": self.params,
                "batch": self.batch,
                "rng": self.rng,
                "digest": self.digest,
            },
            buf,
        )
        return buf.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Request:
        d = torch.load(io.BytesIO(data), weights_only=True)
        return cls(d["step"], d["rank"], d["params"], d["batch"], d["rng"], d["digest"])


@dataclass(frozen=True)
class Answer:
    """A reserve's result for request ``seq``."""

    digest: str
    checker: str  # "host:initial rank" of the reserve
    seconds: float  # the reserve's time for the check (decode, compute, digest)

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, data: bytes) -> Answer:
        d = json.loads(data)
        return cls(str(d["digest"]), str(d["checker"]), float(d["seconds"]))
